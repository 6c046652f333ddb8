//! PG membership changes as processes on loopback: an OSD marked out gives its PGs away
//! and takes them back when marked in, while fio writes and verifies (a binary of its own,
//! so that its four OSDs do not load the other cluster tests).

mod support;

use std::time::{Duration, Instant};

use support::*;

/// Waits until the monitors count OSD `id` down.
fn wait_osd_down(cluster: &ClusterProcesses, id: u64) {
    wait_for("the dead osd down", Duration::from_secs(60), || {
        cluster
            .cli_json(&["osd", "ls"])
            .as_array()
            .is_some_and(|osds| osds.iter().any(|osd| osd["id"] == id && osd["up"] == false))
    });
}

/// Waits until the OSD serving metrics at `metrics` hosts PG replicas as `done` says.
fn wait_hosted(metrics: &str, what: &str, done: impl Fn(f64) -> bool) -> f64 {
    let mut hosted = f64::NAN;
    wait_for(what, Duration::from_secs(180), || {
        hosted = metric(&http_get(metrics, "/metrics"), "basalt_osd_pgs_hosted");
        done(hosted)
    });
    hosted
}

/// From an OSD's log: the snapshots it installed, and the most it was installing at once.
fn snapshot_installs(log: &str) -> (usize, usize) {
    let (mut installed, mut under_way, mut most) = (0, 0usize, 0);
    for line in log.lines() {
        // The messages as the OSD logs them ("...daemon: snapshot installed pg=...").
        if line.contains(": installing a snapshot") {
            under_way += 1;
            most = most.max(under_way);
        } else if line.contains(": snapshot installed") {
            installed += 1;
            under_way = under_way.saturating_sub(1);
        } else if line.contains(": snapshot not installed") {
            under_way = under_way.saturating_sub(1);
        }
    }
    (installed, most)
}

/// An OSD marked out gives its PGs to the others while fio writes (raft membership changes:
/// the new members catch up as learners, then replace it), and hosts nothing once they
/// have; marked in again, PGs move back. Both data sets verify throughout, and after a
/// crash of every OSD (the configurations come back from checkpoints and the log).
#[test]
fn pgs_move_off_an_osd_marked_out_and_back_when_it_is_marked_in() {
    let dir = ScratchDir::new("cluster-out-in");
    let metrics_port = free_port();
    let metrics = format!("127.0.0.1:{metrics_port}");
    let mut osds = vec![(None, Vec::new()); 3];
    // The OSD that goes out and in installs one snapshot at a time when its PGs come back.
    osds.push((
        None,
        vec![
            "--metrics-addr".to_string(),
            metrics.clone(),
            "--max-moves".to_string(),
            "1".to_string(),
        ],
    ));
    let mut cluster =
        ClusterProcesses::start_custom(&dir.path, vec![format!("127.0.0.1:{}", free_port())], osds);
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "16", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "64MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let first = verified_write("32M");
    fio(&uri, &args(&first));
    let before = wait_hosted(&metrics, "the last osd to host pgs", |n| n > 0.0);

    // Out: while fio writes the second half, the PGs leave the OSD.
    let victim = cluster.osd_id(3);
    let started = Instant::now();
    cluster.cli_ok(&["osd", "out", &victim.to_string()]);
    let mut second = verified_write("32M");
    second.push("--offset=32M".into());
    let fio_uri = uri.clone();
    let fio_args = second.clone();
    let fio_run = std::thread::spawn(move || fio(&fio_uri, &args(&fio_args)));
    // While they move, `pg ls` shows them remapped (reported by their leaders).
    let remapped_seen = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (seen, watching) = (remapped_seen.clone(), watching.clone());
        let mon = cluster.mon_addresses()[0].clone();
        std::thread::spawn(move || {
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                let output = basalt()
                    .args(["pg", "ls", "--json", "--mon", &mon])
                    .output()
                    .expect("pg ls");
                if String::from_utf8_lossy(&output.stdout).contains("active+remapped") {
                    seen.store(true, std::sync::atomic::Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    wait_hosted(&metrics, "osd.3 to host no pg", |n| n == 0.0);
    let moved = started.elapsed();
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    watcher.join().expect("watcher");
    eprintln!(
        "pgs seen remapped during the move: {}",
        remapped_seen.load(std::sync::atomic::Ordering::Relaxed)
    );
    let report = fio_run.join().expect("fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(32 << 20)
    );
    cluster.wait_replicas_equal(Duration::from_secs(120));
    // Moved: no PG is left remapped.
    cluster.wait_clean(Duration::from_secs(30));
    eprintln!("{before} pg replicas moved off osd.{victim} in {moved:?}");
    for run in [&first, &second] {
        let mut verify = run.clone();
        verify.push("--verify_only".into());
        fio(&uri, &args(&verify));
    }

    // In: PGs come back to it, by snapshot or log.
    cluster.cli_ok(&["osd", "in", &victim.to_string()]);
    wait_hosted(&metrics, "osd.3 to host pgs again", |n| n > 0.0);
    cluster.wait_replicas_equal(Duration::from_secs(180));
    cluster.wait_clean(Duration::from_secs(30));
    let (installed, most_at_once) = snapshot_installs(&cluster.log_text("osd.3"));
    eprintln!("osd.{victim} installed {installed} snapshots, at most {most_at_once} at once");
    assert!(
        installed >= 2 && most_at_once == 1,
        "osd.{victim} (--max-moves 1) installed {installed} snapshots, {most_at_once} at once"
    );

    // Every OSD crashes and restarts: the configurations are durable.
    drop(target);
    cluster.crash_every_osd();
    cluster.wait_replicas_equal(Duration::from_secs(120));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    for run in [&first, &second] {
        let mut verify = run.clone();
        verify.push("--verify_only".into());
        fio(&uri, &args(&verify));
    }
}

/// Rounds of writes while PGs move and OSDs and monitors crash: in each round, at random
/// moments during fio's writes, one of four OSDs is marked out (or the one out is marked in
/// again), then an OSD, every OSD, or the leading monitor of three and an OSD are killed
/// (`kill -9`) and restarted, so that learners, joint configurations, snapshot transfers
/// and the map's changes meet crashes. Each round's blocks carry a pattern
/// of their own. After each round every PG is active+clean on the map's members, the
/// replicas are equal, and the round's data reads back. `BASALT_MOVES_ROUNDS` (2 by
/// default) and `BASALT_MOVES_SEED` (printed) for longer runs by hand.
#[test]
fn moves_survive_rounds_of_random_crashes() {
    let rounds = env_number("BASALT_MOVES_ROUNDS", 2);
    let mut random = SplitMix::from_env("BASALT_MOVES_SEED");
    let dir = ScratchDir::new("cluster-moves-crashes");
    let device = vec!["--device-size".to_string(), "96MiB".to_string()];
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        (0..3)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect(),
        vec![(None, device); 4],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "24MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let mut out: Option<u32> = None;
    for round in 0..rounds {
        let writes = PatternRound::start(&uri, round, &mut random);
        std::thread::sleep(Duration::from_millis(200 + random.below(1000)));
        let change = match out.take() {
            Some(id) => {
                cluster.cli_ok(&["osd", "in", &id.to_string()]);
                format!("osd.{id} in")
            }
            None => {
                let id = cluster.osd_id(random.below(4) as usize);
                cluster.cli_ok(&["osd", "out", &id.to_string()]);
                out = Some(id);
                format!("osd.{id} out")
            }
        };
        std::thread::sleep(Duration::from_millis(random.below(1500)));
        let crash = match random.below(3) {
            0 => {
                let n = random.below(4) as usize;
                cluster.kill_osd(n);
                std::thread::sleep(Duration::from_millis(random.below(1000)));
                cluster.start_osd(n);
                format!("osd.{} killed", cluster.osd_id(n))
            }
            1 => {
                for n in 0..4 {
                    cluster.kill_osd(n);
                }
                for n in 0..4 {
                    cluster.start_osd(n);
                }
                "every osd killed".to_string()
            }
            _ => {
                // The leading monitor dies while the map's change is carried out; the
                // OSDs' reports, heartbeats and boots go to the next leader.
                let leader = cluster.cli_json(&["status"])["leader"]
                    .as_str()
                    .map(str::to_string);
                let mon = cluster
                    .mon_addresses()
                    .iter()
                    .position(|address| Some(address) == leader.as_ref())
                    .unwrap_or(0);
                let n = random.below(4) as usize;
                cluster.kill_mon_n(mon);
                cluster.kill_osd(n);
                std::thread::sleep(Duration::from_millis(random.below(2000)));
                cluster.start_osd(n);
                std::thread::sleep(Duration::from_millis(random.below(2000)));
                cluster.start_mon_n(mon);
                format!(
                    "monitor {mon} (the leader) and osd.{} killed",
                    cluster.osd_id(n)
                )
            }
        };
        writes.report(&format!("{change}, then {crash}"));
        writes.finish(&cluster, 4, Duration::from_secs(180));
    }
}

/// A dead OSD leaves the cluster for good: `basalt osd rm` refuses while it is up, then
/// while it is in; once it is out and its PGs have moved, it is removed, the health warning
/// about it goes, and its device may not rejoin (its process exits, saying why). The data
/// written before reads back throughout, though the removed OSD led PGs the client had
/// used (the client must forget a leader that is no longer in the map).
#[test]
fn a_dead_osd_is_removed_for_good() {
    let dir = ScratchDir::new("cluster-osd-rm");
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        vec![format!("127.0.0.1:{}", free_port())],
        vec![(None, Vec::new()); 4],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    // 256 objects of 64 KiB: the write touches every PG, so the client has cached the
    // leader of each.
    cluster.cli_ok(&[
        "image",
        "create",
        "rbd/vol",
        "--size",
        "16MiB",
        "--object-size",
        "64KiB",
    ]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let written = verified_write("16M");
    fio(&uri, &args(&written));
    let mut verify = written.clone();
    verify.push("--verify_only".into());

    // The victim is the OSD that leads the most PGs.
    let victim = cluster.busiest_leader();
    let process = cluster.osd_process(victim);
    let refused = |cluster: &ClusterProcesses, what: &str| {
        let output = cluster.cli(&["osd", "rm", &victim.to_string()]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "osd rm went through: {stderr}");
        assert!(
            stderr.contains(&format!("osd.{victim} cannot be removed")) && stderr.contains(what),
            "{stderr}"
        );
    };
    refused(&cluster, "it is up");
    cluster.kill_osd(process);
    wait_osd_down(&cluster, u64::from(victim));
    refused(&cluster, "mark it out first");
    cluster.cli_ok(&["osd", "out", &victim.to_string()]);
    cluster.wait_clean(Duration::from_secs(120));
    cluster.wait_replicas_equal(Duration::from_secs(120));
    assert!(
        cluster.cli_ok(&["status"]).contains("1 osds down"),
        "a dead osd is a warning until it is removed"
    );
    let removed = cluster.cli_ok(&["osd", "rm", &format!("osd.{victim}")]);
    assert!(
        removed.contains(&format!("osd.{victim} removed")),
        "{removed}"
    );
    let osds = cluster.cli_json(&["osd", "ls"]);
    assert_eq!(osds.as_array().map(Vec::len), Some(3), "{osds}");
    assert!(
        osds.as_array()
            .is_some_and(|osds| osds.iter().all(|osd| osd["id"] != victim))
    );
    let status = cluster.cli_ok(&["status"]);
    assert!(!status.contains("osds down"), "{status}");
    let output = cluster.cli(&["osd", "rm", &victim.to_string()]);
    assert!(
        !output.status.success()
            && String::from_utf8_lossy(&output.stderr).contains("does not exist"),
        "a second removal is refused"
    );
    fio(&uri, &args(&verify));

    // Its device cannot come back: the OSD process exits at boot, naming the removal.
    let refused_boot = run(basalt()
        .args(["osd", "--mon", &cluster.mon_addresses()[0], "--data-dir"])
        .arg(dir.join(&format!("osd.{process}"))));
    let stderr = String::from_utf8_lossy(&refused_boot.stderr);
    assert!(!refused_boot.status.success(), "{stderr}");
    assert!(stderr.contains("was removed from the cluster"), "{stderr}");
    fio(&uri, &args(&verify));
}

/// A PG of two replicas that loses one for good has no quorum: its survivor cannot be
/// elected, and moving the PG's members needs a leader. `basalt pg force-quorum` refuses
/// while the dead OSD is only out, naming the removal it needs; once it is removed, the
/// command makes the survivor the PG's only voter, the survivor leads and moves the PG to
/// its new members, and what was written before reads back, after a crash of every OSD too.
#[test]
fn a_pg_whose_voters_are_lost_for_good_leads_again_from_its_survivor() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-force-quorum");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    let (_target, uri) = one_pg_image(&dir.path, &cluster, "p", 2);
    let pgs = cluster.cli_json(&["pg", "ls"]);
    let pg = pgs[0]["pg"].as_str().expect("a pg id").to_string();
    let members: Vec<u64> = pgs[0]["members"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|member| member.as_u64())
        .collect();
    assert_eq!(members.len(), 2, "{pgs}");
    let lost = pgs[0]["leader"].as_u64().unwrap_or(members[0]);
    let survivor = *members
        .iter()
        .find(|m| **m != lost)
        .expect("another member");
    cluster.kill_osd(cluster.osd_process(lost as u32));
    wait_osd_down(&cluster, lost);
    cluster.cli_ok(&["osd", "out", &lost.to_string()]);
    let output = cluster.cli(&["pg", "force-quorum", &pg]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !output.status.success(),
        "forced before the removal: {stderr}"
    );
    assert!(
        stderr.contains("was removed from the cluster") && stderr.contains("osd rm"),
        "{stderr}"
    );
    let replicas = cluster.cli_json(&["pg", "query", &pg]);
    assert!(
        replicas
            .as_array()
            .is_some_and(|replicas| replicas.iter().all(|r| r["leader"].is_null())),
        "the survivor was elected without its lost peer: {replicas}"
    );
    cluster.cli_ok(&["osd", "rm", &lost.to_string()]);
    let named = format!("pg {pg} (removed osd.{lost})");
    wait_for(
        "health to name the pg whose removed voter leaves no quorum",
        Duration::from_secs(30),
        || {
            let (_, checks) = cluster.health();
            checks.contains(&named) && checks.contains("basalt pg force-quorum")
        },
    );
    let text = cluster.cli_ok(&["pg", "force-quorum", &pg]);
    assert!(
        text.contains(&format!("osd.{survivor}: the only voter of pg {pg}"))
            && text.contains(&format!("voters lost: osd.{lost}"))
            && text.contains("it leads"),
        "{text}"
    );
    cluster.wait_clean(Duration::from_secs(90));
    cluster.wait_replicas_equal(Duration::from_secs(60));
    qemu_io_ok(&uri, true, &["read -P 0x5a 0 1M"]);
    qemu_io_ok(&uri, false, &["write -P 0x11 8M 64k"]);
    let (_, checks) = cluster.health();
    assert!(!checks.contains("leave no quorum"), "{checks}");
    let pgs = cluster.cli_json(&["pg", "ls"]);
    let mut members: Vec<u64> = pgs[0]["members"]
        .as_array()
        .expect("members")
        .iter()
        .filter_map(|member| member.as_u64())
        .collect();
    members.sort();
    assert!(!members.contains(&lost), "{pgs}");
    let replicas = cluster.cli_json(&["pg", "query", &pg]);
    for replica in replicas.as_array().expect("replicas") {
        let mut voters: Vec<u64> = replica["voters"]
            .as_array()
            .expect("voters")
            .iter()
            .filter_map(|voter| voter.as_u64())
            .collect();
        voters.sort();
        assert_eq!(voters, members, "{replicas}");
    }
    // The new configuration is in the replicas' logs: it is replayed after a crash.
    for n in 0..3 {
        if cluster.osd_id(n) != lost as u32 {
            cluster.kill_osd(n);
        }
    }
    for n in 0..3 {
        if cluster.osd_id(n) != lost as u32 {
            cluster.start_osd(n);
        }
    }
    cluster.wait_clean(Duration::from_secs(90));
    qemu_io_ok(&uri, true, &["read -P 0x5a 0 1M", "read -P 0x11 8M 64k"]);
}

/// Records of a PG at the end of an OSD's log with nothing before them, as a crash leaves
/// them after a checkpoint that no longer holds the PG (removed from this OSD) and before
/// the removal's record is durable: no raft group can be made of them, and their data kept
/// would keep the OSD's log from being reused for good. Health names the OSD while it keeps
/// them; the PG's leader, asked, says the OSD is no longer a member, and the OSD lets go.
#[test]
fn records_of_a_pg_removed_here_that_replay_cannot_host_are_let_go() {
    let dir = ScratchDir::new("cluster-removal-fragment");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    cluster.cli_ok(&["pool", "create", "p", "--pg-count", "4", "--size", "1"]);
    cluster.wait_clean(Duration::from_secs(60));
    let me = u64::from(cluster.osd_id(0));
    let pgs = cluster.cli_json(&["pg", "ls"]);
    let elsewhere = pgs
        .as_array()
        .and_then(|pgs| {
            pgs.iter().find(|pg| {
                pg["members"]
                    .as_array()
                    .is_some_and(|members| !members.iter().any(|m| m.as_u64() == Some(me)))
            })
        })
        .and_then(|pg| pg["pg"].as_str())
        .unwrap_or_else(|| panic!("a pg without osd.{me}: {pgs}"))
        .to_string();
    let (pool, index) = elsewhere.split_once('.').expect("pool.index");
    let pg = basalt_common::PgId {
        pool: basalt_common::PoolId(pool.parse().expect("pool")),
        index: index.parse().expect("index"),
    };

    cluster.stop_osd(0);
    let device = dir.join("osd.0").join(basalt_osd::daemon::DEVICE_FILE);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let log = basalt_osd::log_device::LogDevice::open(&device)
            .await
            .expect("open the osd's log")
            .device;
        let entries: Vec<basalt_replication::RaftEntry> = (5..=6)
            .map(|index| basalt_replication::RaftEntry {
                term: 1,
                index,
                ..Default::default()
            })
            .collect();
        let hard_state = basalt_replication::HardState {
            term: 1,
            commit: 6,
            ..Default::default()
        };
        let records = basalt_osd::pg_log::to_log_entries(pg, &entries, Some(&hard_state));
        log.submit(records).await.expect("append the fragment");
        log.close().await.expect("close the log");
    });

    let log_since = cluster.log_text("osd.0").len();
    cluster.start_osd(0);
    let held = format!("osd.{me} (pg {elsewhere})");
    // The OSD says at start that it keeps the records (no group could be made of them);
    // health may name it for a moment before the leader's answer comes.
    wait_for(
        "the osd to keep the fragment",
        Duration::from_secs(30),
        || cluster.log_text("osd.0")[log_since..].contains("could not be restored"),
    );
    wait_for(
        "the osd to let the fragment go",
        Duration::from_secs(30),
        || {
            let (_, checks) = cluster.health();
            cluster.log_text("osd.0")[log_since..].contains("pg removed from this osd")
                && !checks.contains(&held)
        },
    );
    let (status, checks) = cluster.health();
    assert!(!checks.contains("cannot host"), "{status}: {checks}");
}
