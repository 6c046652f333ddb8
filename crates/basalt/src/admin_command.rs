//! The cluster's administration commands: pools, images, OSDs, PGs, status.
//!
//! The monitors are found from `--mon`, else `--conf FILE`, else `$BASALT_CONF`, else
//! `/etc/basalt/basalt.toml` (its `[cluster] mons`). Every read command takes `--json`.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use basalt_common::{ByteSize, Epoch, ImageId, OsdId, PgId};
use basalt_mon::MonClient;
use basalt_mon::map::{ClusterMap, Command};
use basalt_mon::protocol::{
    CHECKSUM_ERROR_WARN_SECONDS, ClusterStatus, inconsistent_pgs, member_scrubs, odd_replicas,
};
use basalt_osd::daemon::PgReplicaState;
use basalt_replication::quorum_without;
use serde_json::json;

use crate::daemon_command::{read_config, resolve_mons};

/// Where the monitors are.
#[derive(clap::Args, Clone)]
pub struct ClusterArgs {
    /// Monitor addresses (host:port, comma-separated).
    #[arg(long, value_delimiter = ',', global = true)]
    pub mon: Vec<String>,
    /// A config file naming the monitors.
    #[arg(long, global = true)]
    pub conf: Option<PathBuf>,
}

/// The default config file.
pub const DEFAULT_CONF: &str = "/etc/basalt/basalt.toml";

impl ClusterArgs {
    /// The monitors' addresses, from the first place that names them.
    pub fn mons(&self) -> anyhow::Result<Vec<std::net::SocketAddr>> {
        if !self.mon.is_empty() {
            return resolve_mons(&self.mon);
        }
        let path = self
            .conf
            .clone()
            .or_else(|| std::env::var_os("BASALT_CONF").map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONF));
        if !path.exists() {
            anyhow::bail!(
                "no monitor given: use --mon ADDR, --conf FILE or BASALT_CONF ({} does not exist)",
                path.display()
            );
        }
        let config = read_config(&path)?;
        resolve_mons(&config.cluster.mons)
            .with_context(|| format!("{}: [cluster] mons", path.display()))
    }

    /// A client of the monitors.
    pub fn client(&self) -> anyhow::Result<MonClient> {
        Ok(MonClient::new(self.mons()?).with_deadline(std::time::Duration::from_secs(5)))
    }
}

/// `basalt pool ...`.
#[derive(clap::Subcommand)]
pub enum PoolCommand {
    /// Create a pool.
    Create {
        /// Its name.
        name: String,
        /// Number of PGs (a power of two).
        #[arg(long, default_value_t = 128)]
        pg_count: u32,
        /// Replicas.
        #[arg(long, default_value_t = 3)]
        size: u32,
        /// Replicas needed to accept writes (default: a majority).
        #[arg(long)]
        min_size: Option<u32>,
    },
    /// List pools.
    Ls {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Remove an empty pool.
    Rm {
        /// Its name.
        name: String,
    },
}

/// `basalt image ...`.
#[derive(clap::Subcommand)]
pub enum ImageCommand {
    /// Create an image.
    Create {
        /// POOL/NAME.
        spec: String,
        /// Its size.
        #[arg(long)]
        size: ByteSize,
        /// Bytes per object (a power of two, 4KiB to 64MiB).
        #[arg(long)]
        object_size: Option<ByteSize>,
    },
    /// List images (of one pool, or all).
    Ls {
        /// The pool.
        pool: Option<String>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Show an image.
    Info {
        /// POOL/NAME.
        spec: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Change an image's size.
    Resize {
        /// POOL/NAME.
        spec: String,
        /// The new size.
        #[arg(long)]
        size: ByteSize,
        /// Allow a smaller size: the data past it is discarded, for good.
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Remove an image: refused while a target's bdev uses it, unless forced.
    Rm {
        /// POOL/NAME.
        spec: String,
        /// Remove it even while in use (its users' writes fail from then on).
        #[arg(long)]
        force: bool,
    },
}

fn split_spec(spec: &str) -> anyhow::Result<(String, String)> {
    match spec.split_once('/') {
        Some((pool, name)) if !pool.is_empty() && !name.is_empty() => {
            Ok((pool.to_string(), name.to_string()))
        }
        _ => anyhow::bail!("{spec:?} is not POOL/NAME"),
    }
}

fn block_on<T>(future: impl std::future::Future<Output = anyhow::Result<T>>) -> anyhow::Result<T> {
    crate::control_runtime()?.block_on(future)
}

fn print_json(value: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).expect("values serialise")
    );
}

async fn apply(mon: &MonClient, command: Command) -> anyhow::Result<u64> {
    let (_, epoch) = mon.command(command).await?;
    Ok(epoch.0)
}

pub fn run_pool(cluster: ClusterArgs, command: PoolCommand) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    block_on(async move {
        match command {
            PoolCommand::Create {
                name,
                pg_count,
                size,
                min_size,
            } => {
                let epoch = apply(
                    &mon,
                    Command::PoolCreate {
                        name: name.clone(),
                        pg_count,
                        size,
                        min_size,
                    },
                )
                .await?;
                println!(
                    "pool {name:?} created ({pg_count} pgs, {size} replicas; map epoch {epoch})"
                );
            }
            PoolCommand::Ls { json } => {
                let map = mon.map().await?;
                let images = |pool| map.images.values().filter(|i| i.pool == pool).count();
                if json {
                    print_json(&json!(
                        map.pools
                            .values()
                            .map(|p| json!({
                                "id": p.id.0, "name": p.name, "pg_count": p.pg_count,
                                "size": p.size, "min_size": p.min_size, "images": images(p.id),
                            }))
                            .collect::<Vec<_>>()
                    ));
                } else {
                    println!(
                        "{:<5} {:<20} {:>8} {:>5} {:>9} {:>7}",
                        "ID", "NAME", "PGS", "SIZE", "MIN_SIZE", "IMAGES"
                    );
                    for p in map.pools.values() {
                        println!(
                            "{:<5} {:<20} {:>8} {:>5} {:>9} {:>7}",
                            p.id.0,
                            p.name,
                            p.pg_count,
                            p.size,
                            p.min_size,
                            images(p.id)
                        );
                    }
                }
            }
            PoolCommand::Rm { name } => {
                let epoch = apply(&mon, Command::PoolRemove { name: name.clone() }).await?;
                println!("pool {name:?} removed (map epoch {epoch})");
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

fn image_json(map: &ClusterMap, image: &basalt_mon::map::Image) -> serde_json::Value {
    let pool = map.pools.get(&image.pool).map_or("?", |p| p.name.as_str());
    json!({
        "id": image.id.0,
        "pool": pool,
        "name": image.name,
        "size_bytes": image.size_bytes,
        "object_size_bytes": image.object_size_bytes,
        "objects": image.size_bytes.div_ceil(image.object_size_bytes),
    })
}

/// The map from a monitor that has epoch `at_least` at least (a follower may lag).
async fn map_since(mon: &MonClient, at_least: Epoch) -> anyhow::Result<ClusterMap> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut map = mon.map().await?;
    while map.epoch < at_least {
        if std::time::Instant::now() > deadline {
            anyhow::bail!(
                "the monitors answer with map epoch {}, not yet {} (try again)",
                map.epoch.0,
                at_least.0
            );
        }
        let after = Epoch(at_least.0.saturating_sub(1));
        if let Some(newer) = mon
            .map_after(after, std::time::Duration::from_secs(1))
            .await?
        {
            map = newer;
        }
    }
    Ok(map)
}

/// Discards what the map keeps of image `id` (`spec` names it) for discards alone: what a
/// shrink cut off, or all of it once removed, starting from `map`, one that has the
/// change (nothing is connected when nothing is kept). The map's change comes first, so that OSDs refuse writes there from then
/// on and none lands after the discard; the map forgets the bytes once they are discarded
/// (`ImageDiscarded`, for the cut they were discarded for). Without the discard the objects
/// would stay on the OSDs, for good after a removal (image ids are not given again) and to
/// be read back by a later grow after a shrink. Discards go on full OSDs too. When another
/// command changed the image meanwhile (finished the discard and grew it, or cut off more),
/// OSDs refuse what is no longer kept for discards, and this looks again. An interrupted
/// discard is finished by running the command again (health names the image meanwhile).
async fn finish_cut(
    mon: &MonClient,
    mons: &[std::net::SocketAddr],
    (spec, id): (&str, ImageId),
    map: ClusterMap,
) -> anyhow::Result<u64> {
    /// Discarded per call at most: 1 GiB, a few hundred objects' requests.
    const STEP: u64 = 1 << 30;
    /// Looks at the map again at most this often when other commands change the image.
    const ROUNDS: usize = 8;
    let context = || {
        format!(
            "cannot discard the data of image {spec} cut off (run the command again to finish it)"
        )
    };
    let left = |map: &ClusterMap| {
        map.image_range(id, true)
            .map(|(image, kept)| (image.cut_epoch, kept))
            .filter(|(_, kept)| !kept.is_empty())
    };
    let mut cluster = None;
    let mut map = map;
    let mut discarded = 0;
    for _ in 0..ROUNDS {
        let Some((since, kept)) = left(&map) else {
            return Ok(discarded);
        };
        discarded = 0;
        let cluster = match &cluster {
            Some(cluster) => cluster,
            None => cluster.insert(
                basalt_client::Cluster::connect(mons.to_vec())
                    .await
                    .with_context(context)?,
            ),
        };
        // Only what holds data: a thin image's removal then costs a request per PG
        // rather than one per object.
        let (ranges, unlisted) = written_ranges(mons, &map, id, kept.clone(), since).await?;
        if let Some((pg, why)) = unlisted.first() {
            let others = match unlisted.len() - 1 {
                0 => String::new(),
                more => format!(" (and {more} other PGs)"),
            };
            eprintln!("note: {why}; every object of image {spec} in pg {pg}{others} is discarded");
        }
        let mut failed = None;
        for call in steps_of(&ranges, STEP) {
            if let Err(error) = cluster.discard_cut(id, &call, map.epoch).await {
                failed = Some(error);
                break;
            }
            discarded += call
                .iter()
                .map(|range| range.end - range.start)
                .sum::<u64>();
        }
        let next = match failed {
            None => {
                let discarded = Command::ImageDiscarded {
                    id,
                    from: kept.start,
                    to: kept.end,
                    since,
                };
                Epoch(apply(mon, discarded).await.with_context(context)?)
            }
            Some(error) => {
                let now = map_since(mon, map.epoch).await.with_context(context)?;
                if left(&now) == Some((since, kept)) {
                    return Err(error).with_context(context);
                }
                now.epoch
            }
        };
        map = map_since(mon, next.max(map.epoch))
            .await
            .with_context(context)?;
    }
    Err(anyhow::anyhow!("image {spec} kept changing meanwhile")).with_context(context)
}

/// `ranges` cut into calls of at most `step` bytes each.
fn steps_of(ranges: &[Range<u64>], step: u64) -> Vec<Vec<Range<u64>>> {
    let mut calls = Vec::new();
    let mut call = Vec::new();
    let mut room = step;
    for range in ranges {
        let mut at = range.start;
        while at < range.end {
            let to = range.end.min(at.saturating_add(room));
            call.push(at..to);
            room -= to - at;
            at = to;
            if room == 0 {
                calls.push(std::mem::take(&mut call));
                room = step;
            }
        }
    }
    if !call.is_empty() {
        calls.push(call);
    }
    calls
}

/// Fails if image `id` (`spec`) has watchers: a target's bdev uses it. Monitors of an
/// older version, which do not know, get a note and no refusal.
async fn refuse_if_watched(mon: &MonClient, spec: &str, id: ImageId) -> anyhow::Result<()> {
    use basalt_mon::protocol::{MonReply, MonRequest, WATCH_TTL};
    // The monitors' leader may hold the answer for up to WATCH_TTL (a new one).
    let ask = MonRequest::Watchers { image: id };
    match mon.request_waiting(&ask, WATCH_TTL).await? {
        MonReply::Watchers(watchers) if watchers.is_empty() => Ok(()),
        MonReply::Watchers(watchers) => anyhow::bail!(
            "image {spec} is in use by {} (remove it from there first, or pass --force to \
             remove it all the same: their writes fail from then on)",
            watchers.join(", ")
        ),
        other => {
            eprintln!("note: the monitors do not say whether image {spec} is in use: {other:?}");
            Ok(())
        }
    }
}

/// The parts of `kept`, bytes of image `id` kept for discards alone in `map` since the
/// map of epoch `since`, that hold data: the objects that the leaders of the image's
/// pool's PGs list ([`basalt_osd::daemon::OsdRequest::ListObjects`]), cut to `kept`,
/// adjacent ones merged. A PG that gives no list within [`LISTING_WITHIN`] (an OSD of an
/// older version, no leader) has every object of `kept` it holds in the ranges; those
/// PGs come second, each with the reason. A PG that moves meanwhile is asked where the
/// monitors (`mons`) say it is now.
async fn written_ranges(
    mons: &[std::net::SocketAddr],
    map: &ClusterMap,
    id: ImageId,
    kept: Range<u64>,
    since: Epoch,
) -> anyhow::Result<(Vec<Range<u64>>, Vec<(PgId, String)>)> {
    /// PGs asked at once.
    const PGS_AT_ONCE: usize = 64;
    let (image, _) = map
        .image_range(id, true)
        .with_context(|| format!("image {} is not in the map", id.0))?;
    let object_size = image.object_size_bytes;
    anyhow::ensure!(object_size > 0, "image {} has objects of 0 bytes", id.0);
    let pool = map
        .pools
        .get(&image.pool)
        .with_context(|| format!("pool {} is not in the map", image.pool))?;
    let objects = kept.start / object_size..kept.end.div_ceil(object_size);
    let pgs: Vec<PgId> = (0..pool.pg_count)
        .map(|index| PgId {
            pool: image.pool,
            index,
        })
        .collect();
    let mon = std::sync::Arc::new(MonClient::new(mons.to_vec()));
    let mut numbers = Vec::new();
    let mut unlisted = Vec::new();
    for group in pgs.chunks(PGS_AT_ONCE) {
        let mut lists = tokio::task::JoinSet::new();
        for pg in group {
            let (map, mon, pg, from) = (map.clone(), mon.clone(), *pg, objects.start);
            lists.spawn(async move { (pg, list_objects(&mon, map, pg, id, from, since).await) });
        }
        while let Some(joined) = lists.join_next().await {
            let (pg, listed) = joined.context("a listing task failed")?;
            match listed {
                Ok(listed) => numbers.extend(listed),
                Err(why) => unlisted.push((pg, why)),
            }
        }
    }
    if !unlisted.is_empty() {
        let unlisted: BTreeSet<PgId> = unlisted.iter().map(|(pg, _)| *pg).collect();
        numbers.extend(objects.clone().filter(|number| {
            unlisted.contains(&pool.pg_of(basalt_common::ObjectKey {
                image: id,
                number: *number,
            }))
        }));
    }
    numbers.sort_unstable();
    numbers.dedup();
    let mut ranges: Vec<Range<u64>> = Vec::new();
    for number in numbers {
        let start = number.saturating_mul(object_size).max(kept.start);
        let end = number
            .saturating_add(1)
            .saturating_mul(object_size)
            .min(kept.end);
        if start >= end {
            continue;
        }
        match ranges.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => ranges.push(start..end),
        }
    }
    unlisted.sort_by_key(|(pg, _)| *pg);
    Ok((ranges, unlisted))
}

/// How long [`written_ranges`] waits for a PG's list.
const LISTING_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);

/// The numbers of image `id`'s objects from `from` on that `pg`'s leader holds data of,
/// under a map of epoch `since` or newer; asked of the PG's members as `map` names them,
/// again and again until one answers or [`LISTING_WITHIN`] has passed, and as the newer
/// maps `mon` gives after a round that none answered name them too (the PG may move).
async fn list_objects(
    mon: &MonClient,
    map: ClusterMap,
    pg: PgId,
    id: ImageId,
    from: u64,
    since: Epoch,
) -> Result<Vec<u64>, String> {
    use basalt_osd::daemon::{ObjectList, OsdRequest};
    let members_in = |map: &ClusterMap| {
        map.pg(pg)
            .map(|entry| entry.members.clone())
            .ok_or_else(|| format!("pg {pg} is not in the map"))
    };
    let members = members_in(&map)?;
    let deadline = std::time::Instant::now() + LISTING_WITHIN;
    let mut placed = (map, members);
    let mut ask = async |from| {
        let (map, members) = &mut placed;
        loop {
            let mut refusals = Vec::new();
            for osd in members.iter() {
                let request = OsdRequest::ListObjects {
                    pg,
                    image: id,
                    from,
                    since,
                };
                let within = std::time::Duration::from_secs(5);
                match ask_osd_for::<ObjectList>(map, *osd, &request, within).await {
                    Ok(list) => return Ok(list),
                    Err(error) => refusals.push(format!("{osd}: {error}")),
                }
            }
            if std::time::Instant::now() >= deadline {
                return Err(format!(
                    "pg {pg} gave no list of image {}'s objects ({})",
                    id.0,
                    refusals.join("; ")
                ));
            }
            // A round at most every `pause`, waiting that long for a newer map; a moved
            // PG's new members are asked besides the old (which hold its replicas until
            // the move ends, and may lead it meanwhile).
            let pause = std::time::Duration::from_millis(200);
            let started = std::time::Instant::now();
            let newer = tokio::time::timeout(2 * pause, mon.map_after(map.epoch, pause)).await;
            if let Ok(Ok(Some(newer))) = newer
                && let Ok(now) = members_in(&newer)
            {
                for osd in now {
                    if !members.contains(&osd) {
                        members.push(osd);
                    }
                }
                *map = newer;
            }
            tokio::time::sleep(pause.saturating_sub(started.elapsed())).await;
        }
    };
    let mut numbers = Vec::new();
    let mut from = from;
    loop {
        let list = ask(from).await?;
        let Some(last) = list.numbers.last().copied() else {
            return Ok(numbers);
        };
        numbers.extend(list.numbers);
        if list.complete || last == u64::MAX {
            return Ok(numbers);
        }
        from = last + 1;
    }
}

pub fn run_image(cluster: ClusterArgs, command: ImageCommand) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    let mons = cluster.mons()?;
    block_on(async move {
        match command {
            ImageCommand::Create {
                spec,
                size,
                object_size,
            } => {
                let (pool, name) = split_spec(&spec)?;
                let epoch = apply(
                    &mon,
                    Command::ImageCreate {
                        pool,
                        name,
                        size_bytes: size.0,
                        object_size_bytes: object_size.map(|s| s.0),
                    },
                )
                .await?;
                println!("image {spec} created ({size}; map epoch {epoch})");
            }
            ImageCommand::Ls { pool, json } => {
                let map = mon.map().await?;
                if let Some(pool) = &pool
                    && map.pool_by_name(pool).is_none()
                {
                    anyhow::bail!("pool {pool:?} does not exist");
                }
                let images: Vec<_> = map
                    .images
                    .values()
                    .filter(|image| {
                        pool.as_ref().is_none_or(|pool| {
                            map.pools.get(&image.pool).is_some_and(|p| &p.name == pool)
                        })
                    })
                    .collect();
                if json {
                    print_json(&json!(
                        images
                            .iter()
                            .map(|i| image_json(&map, i))
                            .collect::<Vec<_>>()
                    ));
                } else {
                    println!("{:<30} {:>12} {:>12}", "IMAGE", "SIZE", "OBJECT_SIZE");
                    for image in images {
                        let pool = map.pools.get(&image.pool).map_or("?", |p| p.name.as_str());
                        println!(
                            "{:<30} {:>12} {:>12}",
                            format!("{pool}/{}", image.name),
                            ByteSize(image.size_bytes).to_string(),
                            ByteSize(image.object_size_bytes).to_string()
                        );
                    }
                }
            }
            ImageCommand::Info { spec, json } => {
                let (pool, name) = split_spec(&spec)?;
                let map = mon.map().await?;
                if map.pool_by_name(&pool).is_none() {
                    anyhow::bail!("pool {pool:?} does not exist");
                }
                let image = map
                    .image_by_name(&pool, &name)
                    .with_context(|| format!("image {spec} does not exist"))?;
                let value = image_json(&map, image);
                if json {
                    print_json(&value);
                } else {
                    println!("image {spec}");
                    println!("  id:          {}", image.id.0);
                    println!(
                        "  size:        {} ({} bytes)",
                        ByteSize(image.size_bytes),
                        image.size_bytes
                    );
                    println!("  object size: {}", ByteSize(image.object_size_bytes));
                    println!("  objects:     {}", value["objects"]);
                }
            }
            ImageCommand::Resize {
                spec,
                size,
                allow_shrink,
            } => {
                let (pool, name) = split_spec(&spec)?;
                let map = mon.map().await?;
                // What an earlier shrink left to discard goes first (the image may not
                // grow over it).
                if let Some(image) = map.image_by_name(&pool, &name) {
                    finish_cut(&mon, &mons, (&spec, image.id), map.clone()).await?;
                }
                let resize = Command::ImageResize {
                    pool: pool.clone(),
                    name: name.clone(),
                    size_bytes: size.0,
                    grow_only: !allow_shrink,
                };
                let epoch = apply(&mon, resize).await?;
                // Shrunk: the part cut off is discarded now that no write reaches it.
                let map = map_since(&mon, Epoch(epoch)).await?;
                let discarded = match map.image_by_name(&pool, &name) {
                    Some(image) => finish_cut(&mon, &mons, (&spec, image.id), map.clone()).await?,
                    None => 0,
                };
                println!("image {spec} resized to {size} (map epoch {epoch})");
                if discarded > 0 {
                    println!(
                        "image {spec}: {} of data cut off discarded",
                        ByteSize(discarded)
                    );
                }
            }
            ImageCommand::Rm { spec, force } => {
                let (pool, name) = split_spec(&spec)?;
                // Removals of this name not finished (their discards interrupted).
                let removing = |map: &ClusterMap| -> Vec<ImageId> {
                    let Some(found) = map.pool_by_name(&pool) else {
                        return Vec::new();
                    };
                    map.removing
                        .values()
                        .filter(|image| image.pool == found.id && image.name == name)
                        .map(|image| image.id)
                        .collect()
                };
                let map = mon.map().await?;
                let unfinished = removing(&map);
                // An interrupted removal is finished first, alone: the image of that name
                // now may be another, created since, which the operator did not ask about
                // yet (running the command again removes it).
                if !unfinished.is_empty() {
                    for id in unfinished {
                        finish_cut(&mon, &mons, (&spec, id), map.clone()).await?;
                    }
                    println!(
                        "image {spec}: the removal left unfinished is done, its data discarded"
                    );
                    if map.image_by_name(&pool, &name).is_some() {
                        println!(
                            "image {spec} exists again (created since): run the command again \
                             to remove it"
                        );
                    }
                    return Ok(ExitCode::SUCCESS);
                }
                let seen = map.image_by_name(&pool, &name).map(|image| image.id);
                if let Some(id) = seen
                    && !force
                {
                    refuse_if_watched(&mon, &spec, id).await?;
                }
                // The image seen, not another given the name since.
                let remove = Command::ImageRemove {
                    pool: pool.clone(),
                    name: name.clone(),
                    id: seen,
                };
                let epoch = apply(&mon, remove).await?;
                println!("image {spec} removed (map epoch {epoch}); discarding its data");
                // The image removed, whichever it was by then (read again: it may have
                // been removed and created again since this command looked).
                let map = map_since(&mon, Epoch(epoch)).await?;
                let mut discarded = 0;
                for id in removing(&map) {
                    discarded += finish_cut(&mon, &mons, (&spec, id), map.clone()).await?;
                }
                println!(
                    "image {spec}: its data is discarded ({} discarded)",
                    ByteSize(discarded)
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

pub fn run_osd_ls(cluster: ClusterArgs, json: bool) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    block_on(async move {
        let map = mon.map().await?;
        if json {
            print_json(&serde_json::to_value(
                map.osds.values().collect::<Vec<_>>(),
            )?);
        } else {
            println!(
                "{:<8} {:<16} {:<22} {:<5} {:<4} {:>6}  SPACE",
                "ID", "HOST", "ADDRESS", "UP", "IN", "WEIGHT"
            );
            for osd in map.osds.values() {
                println!(
                    "{:<8} {:<16} {:<22} {:<5} {:<4} {:>6.2}  {}",
                    osd.id.to_string(),
                    osd.host,
                    osd.address,
                    if osd.up { "up" } else { "down" },
                    if osd.is_in { "in" } else { "out" },
                    osd.weight,
                    if osd.full { "full" } else { "ok" }
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// An OSD id as operators write it: `3` or `osd.3`.
fn parse_osd_id(id: &str) -> anyhow::Result<OsdId> {
    let number = id.strip_prefix("osd.").unwrap_or(id);
    number
        .parse()
        .map(OsdId)
        .map_err(|_| anyhow::anyhow!("{id:?} is not an OSD id (3 or osd.3)"))
}

/// `basalt osd rm ID`.
pub fn run_osd_rm(cluster: ClusterArgs, id: &str) -> anyhow::Result<ExitCode> {
    let id = parse_osd_id(id)?;
    let mon = cluster.client()?;
    block_on(async move {
        let epoch = apply(&mon, Command::OsdRemove { id }).await?;
        println!("{id} removed from the cluster (map epoch {epoch})");
        Ok(ExitCode::SUCCESS)
    })
}

/// `basalt osd out|in ID`.
pub fn run_osd_mark(cluster: ClusterArgs, id: &str, is_in: bool) -> anyhow::Result<ExitCode> {
    let id = parse_osd_id(id)?;
    let mon = cluster.client()?;
    block_on(async move {
        let command = if is_in {
            Command::OsdIn { id }
        } else {
            Command::OsdOut { id, auto: false }
        };
        let epoch = apply(&mon, command).await?;
        let state = if is_in { "in" } else { "out" };
        println!("{id} marked {state} (map epoch {epoch})");
        Ok(ExitCode::SUCCESS)
    })
}

/// Each PG's state, from the map and the OSDs' reports.
fn pg_states(status: &ClusterStatus) -> Vec<(PgId, Vec<OsdId>, Option<OsdId>, &'static str)> {
    let mut leaders: BTreeMap<PgId, OsdId> = BTreeMap::new();
    let mut moving: BTreeSet<PgId> = BTreeSet::new();
    for (osd, report) in &status.reports {
        for pg in &report.leading {
            leaders.insert(*pg, *osd);
        }
        moving.extend(report.moving.iter().copied());
    }
    let map = &status.map;
    let mut states = Vec::new();
    for pool in map.pools.values() {
        for (index, entry) in pool.pgs.iter().enumerate() {
            let pg = PgId {
                pool: pool.id,
                index: index as u32,
            };
            let leader = leaders.get(&pg).copied();
            let up = entry
                .members
                .iter()
                .filter(|osd| map.osds.get(osd).is_some_and(|o| o.up))
                .count();
            let state = if entry.members.is_empty() {
                "unplaced"
            } else if leader.is_none() {
                "inactive"
            } else if up < entry.members.len() || entry.members.len() < pool.size as usize {
                "active+degraded"
            } else if moving.contains(&pg) {
                // Its replicas are moving to the members the map gives it.
                "active+remapped"
            } else {
                "active+clean"
            };
            states.push((pg, entry.members.clone(), leader, state));
        }
    }
    // The background scrubs' verdicts: `+inconsistent`, as Ceph shows it.
    let members = states
        .iter()
        .map(|(pg, members, _, _)| (*pg, members.clone()));
    let inconsistent: BTreeSet<PgId> = inconsistent_pgs(&status.reports, members)
        .into_iter()
        .map(|(pg, _)| pg)
        .collect();
    for (pg, _, _, state) in &mut states {
        *state = match (*state, inconsistent.contains(pg)) {
            ("active+degraded", true) => "active+degraded+inconsistent",
            ("active+remapped", true) => "active+remapped+inconsistent",
            ("active+clean", true) => "active+clean+inconsistent",
            (state, _) => state,
        };
    }
    states
}

pub fn run_pg_ls(cluster: ClusterArgs, json: bool) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    block_on(async move {
        let status = mon.status().await?;
        let states = pg_states(&status);
        if json {
            print_json(&json!(
                states
                    .iter()
                    .map(|(pg, members, leader, state)| json!({
                        "pg": pg.to_string(),
                        "members": members.iter().map(|m| m.0).collect::<Vec<_>>(),
                        "leader": leader.map(|l| l.0),
                        "state": state,
                    }))
                    .collect::<Vec<_>>()
            ));
        } else {
            println!("{:<10} {:<20} {:<8} STATE", "PG", "MEMBERS", "LEADER");
            for (pg, members, leader, state) in states {
                let members: Vec<String> = members.iter().map(|m| m.0.to_string()).collect();
                println!(
                    "{:<10} {:<20} {:<8} {state}",
                    pg.to_string(),
                    format!("[{}]", members.join(",")),
                    leader.map_or("-".to_string(), |l| l.0.to_string())
                );
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// The inactive PGs whose voters, as a replica of each reports them
/// (`OsdReport::leaderless`), make no quorum without those removed from the cluster (lost
/// for good), each with the removed ones: `pg 1.0 (removed osd.2)`.
fn lost_quorum(
    status: &ClusterStatus,
    states: &[(PgId, Vec<OsdId>, Option<OsdId>, &'static str)],
) -> Vec<String> {
    let removed = |osd: &OsdId| status.map.removed.contains_key(osd);
    states
        .iter()
        .filter(|(_, _, _, state)| state.starts_with("inactive"))
        .filter_map(|(pg, _, _, _)| {
            let conf = status
                .reports
                .iter()
                .flat_map(|(_, report)| &report.leaderless)
                .find(|leaderless| leaderless.pg == *pg)?;
            if quorum_without(&conf.voters, &conf.voters_outgoing, removed) {
                return None;
            }
            let gone: BTreeSet<&OsdId> = conf
                .voters
                .iter()
                .chain(&conf.voters_outgoing)
                .filter(|osd| removed(osd))
                .collect();
            Some(format!("pg {pg} (removed {})", osd_names(gone)))
        })
        .collect()
}

/// The health checks that fail, as `ceph -s` names them, and whether one is an error
/// (data found to differ between replicas) rather than a warning.
fn health(
    status: &ClusterStatus,
    states: &[(PgId, Vec<OsdId>, Option<OsdId>, &'static str)],
) -> (Vec<String>, bool) {
    let map = &status.map;
    let mut warnings = Vec::new();
    // The background scrubs' verdicts, from the OSDs' reports.
    let inconsistent = inconsistent_pgs(
        &status.reports,
        states
            .iter()
            .map(|(pg, members, _, _)| (*pg, members.clone())),
    );
    if !inconsistent.is_empty() {
        let named: Vec<String> = inconsistent
            .iter()
            .map(|(pg, odd)| {
                let odd: Vec<String> = odd.iter().map(ToString::to_string).collect();
                format!("pg {pg} ({})", odd.join(", "))
            })
            .collect();
        warnings.push(format!(
            "{} pgs inconsistent: {} (`basalt pg repair PG` rebuilds the odd replicas)",
            inconsistent.len(),
            named.join(", ")
        ));
    }
    // Ceph's MON_DOWN. An older leader tells no quorum: nothing to say then.
    let out_of_quorum: Vec<&str> = status
        .monitors
        .iter()
        .filter(|monitor| !status.quorum.contains(monitor))
        .map(String::as_str)
        .collect();
    if !status.quorum.is_empty() && !out_of_quorum.is_empty() {
        warnings.push(format!(
            "{}/{} monitors out of quorum: {} (quorum {})",
            out_of_quorum.len(),
            status.monitors.len(),
            out_of_quorum.join(","),
            status.quorum.join(",")
        ));
    }
    if map.osds.is_empty() {
        warnings.push("no osds".to_string());
    }
    let down = map.osds.values().filter(|o| !o.up).count();
    if down > 0 {
        warnings.push(format!("{down} osds down"));
    }
    let out = map.osds.values().filter(|o| !o.is_in).count();
    if out > 0 {
        warnings.push(format!("{out} osds out"));
    }
    // A PG with no leader whose replica holds raft log entries it cannot send: the
    // operator's command, if the replicas that may hold them too are lost for good.
    let unfound: Vec<String> = states
        .iter()
        .filter(|(_, _, _, state)| state.starts_with("inactive"))
        .filter_map(|(pg, members, _, _)| {
            let holders: Vec<String> = status
                .reports
                .iter()
                .filter(|(osd, report)| members.contains(osd) && report.unsendable.contains(pg))
                .map(|(osd, _)| osd.to_string())
                .collect();
            (!holders.is_empty()).then(|| format!("pg {pg} ({})", holders.join(", ")))
        })
        .collect();
    if !unfound.is_empty() {
        warnings.push(format!(
            "{} pgs inactive with raft log entries a replica cannot send: {} (if the replicas \
             that may hold them too are lost for good, `basalt pg mark-unfound-lost PG` has \
             it give them up)",
            unfound.len(),
            unfound.join(", ")
        ));
    }
    let no_quorum = lost_quorum(status, states);
    if !no_quorum.is_empty() {
        warnings.push(format!(
            "{} pgs inactive whose voters removed from the cluster leave no quorum: {} (`basalt \
             pg force-quorum PG` makes the surviving replica with the most of the raft log the \
             only voter; writes that only the removed OSDs held are lost)",
            no_quorum.len(),
            no_quorum.join(", ")
        ));
    }
    for state in ["inactive", "active+degraded", "unplaced"] {
        // (`active+degraded+inconsistent` counts as degraded too.)
        let count = states.iter().filter(|s| s.3.starts_with(state)).count();
        if count > 0 {
            warnings.push(format!("{count} pgs {state}"));
        }
    }
    // From the map: the flag is what makes leaders refuse writes.
    let full: Vec<String> = status
        .map
        .osds
        .values()
        .filter(|osd| osd.holds_writes_back())
        .map(|osd| osd.id.to_string())
        .collect();
    if !full.is_empty() {
        warnings.push(format!(
            "{} osds full, writes refused: {}",
            full.len(),
            full.join(", ")
        ));
    }
    // From the reports: an OSD's own fill, so that one small OSD is seen before the
    // others' free space hides it.
    let nearly_full: Vec<String> = status
        .reports
        .iter()
        .filter_map(|(id, report)| Some(format!("{id} {}%", report.nearly_full_percent()?)))
        .collect();
    if !nearly_full.is_empty() {
        warnings.push(format!(
            "{} osds nearly full: {}",
            nearly_full.len(),
            nearly_full.join(", ")
        ));
    }
    // Devices that gave back bytes other than those written, lately: the copies are
    // rebuilt, but the device may be failing.
    let damaged: Vec<String> = status
        .reports
        .iter()
        .filter_map(|(id, report)| {
            let age = report
                .last_checksum_error_age_seconds
                .filter(|age| *age < CHECKSUM_ERROR_WARN_SECONDS)?;
            Some(format!(
                "{id} ({} reads, the last {age} s ago)",
                report.checksum_errors
            ))
        })
        .collect();
    if !damaged.is_empty() {
        warnings.push(format!(
            "{} osds read blocks failing their checksum in the last hour: {} (the damaged \
             copies are rebuilt from other replicas; check those devices)",
            damaged.len(),
            damaged.join(", ")
        ));
    }
    // Cut-off data whose discard is under way, or was interrupted: it takes space.
    let image_name = |image: &basalt_mon::map::Image| {
        let pool = status.map.pools.get(&image.pool);
        format!(
            "{}/{}",
            pool.map_or("?", |pool| pool.name.as_str()),
            image.name
        )
    };
    let cut: Vec<String> = (status.map.removing.values())
        .map(|image| format!("{} (removed)", image_name(image)))
        .chain(
            (status.map.images.values())
                .filter(|image| image.discard_to > image.size_bytes)
                .map(|image| format!("{} (shrunk)", image_name(image))),
        )
        .collect();
    if !cut.is_empty() {
        warnings.push(format!(
            "{} images' cut-off data being discarded: {} (if no `basalt image rm` or \
             `image resize` is running, run it again to finish)",
            cut.len(),
            cut.join(", ")
        ));
    }
    // An OSD that keeps data it cannot host stops reusing its log: it fills.
    let held: Vec<String> = status
        .reports
        .iter()
        .filter(|(_, report)| !report.held.is_empty())
        .map(|(id, report)| {
            let pgs: Vec<String> = report.held.iter().map(ToString::to_string).collect();
            format!("{id} (pg {})", pgs.join(", "))
        })
        .collect();
    if !held.is_empty() {
        warnings.push(format!(
            "{} osds keep records of pgs they cannot host, their logs not reused until those \
             are hosted or let go: {}",
            held.len(),
            held.join("; ")
        ));
    }
    (warnings, !inconsistent.is_empty())
}

pub fn run_status(cluster: ClusterArgs, json: bool) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    block_on(async move {
        let status = mon.status().await?;
        let states = pg_states(&status);
        let (warnings, error) = health(&status, &states);
        let map = &status.map;
        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
        for state in &states {
            *by_state.entry(state.3).or_default() += 1;
        }
        let used: u64 = status.reports.iter().map(|(_, r)| r.used_bytes).sum();
        let capacity: u64 = status.reports.iter().map(|(_, r)| r.capacity_bytes).sum();
        let up = map.osds.values().filter(|o| o.up).count();
        let is_in = map.osds.values().filter(|o| o.is_in).count();
        let health_name = if error {
            "HEALTH_ERR"
        } else if warnings.is_empty() {
            "HEALTH_OK"
        } else {
            "HEALTH_WARN"
        };
        if json {
            print_json(&json!({
                "health": {"status": health_name, "checks": warnings},
                "epoch": map.epoch.0,
                "monitors": status.monitors,
                "quorum": status.quorum,
                "leader": status.leader,
                "osds": {"total": map.osds.len(), "up": up, "in": is_in},
                "pools": map.pools.len(),
                "pgs": states.len(),
                "pgs_by_state": by_state,
                "images": map.images.len(),
                "used_bytes": used,
                "capacity_bytes": capacity,
                "client": {
                    "read_ops_per_second": status.ops_per_second.0,
                    "write_ops_per_second": status.ops_per_second.1,
                    "read_bytes_per_second": status.bytes_per_second.0,
                    "write_bytes_per_second": status.bytes_per_second.1,
                },
            }));
            return Ok(ExitCode::SUCCESS);
        }
        println!("  cluster:");
        println!("    epoch:  {}", map.epoch.0);
        println!("    health: {health_name}");
        for warning in &warnings {
            println!("            {warning}");
        }
        println!();
        println!("  services:");
        println!(
            "    mon: {} daemons, quorum {} (leader {})",
            status.monitors.len(),
            status.quorum.join(","),
            status.leader
        );
        println!("    osd: {} osds: {up} up, {is_in} in", map.osds.len());
        println!();
        println!("  data:");
        println!(
            "    pools:   {} pools, {} pgs",
            map.pools.len(),
            states.len()
        );
        println!("    images:  {} images", map.images.len());
        println!(
            "    usage:   {} used, {} / {} avail",
            ByteSize(used).approx(),
            ByteSize(capacity.saturating_sub(used)).approx(),
            ByteSize(capacity).approx()
        );
        let pgs: Vec<String> = by_state
            .iter()
            .map(|(state, n)| format!("{n} {state}"))
            .collect();
        println!(
            "    pgs:     {}",
            if pgs.is_empty() {
                "none".to_string()
            } else {
                pgs.join(", ")
            }
        );
        println!();
        println!("  io:");
        println!(
            "    client:   {}/s rd, {}/s wr, {:.0} op/s rd, {:.0} op/s wr",
            ByteSize(status.bytes_per_second.0 as u64).approx(),
            ByteSize(status.bytes_per_second.1 as u64).approx(),
            status.ops_per_second.0,
            status.ops_per_second.1
        );
        Ok(ExitCode::SUCCESS)
    })
}

fn parse_pg(text: &str) -> anyhow::Result<PgId> {
    let parsed = text.split_once('.').and_then(|(pool, index)| {
        Some(PgId {
            pool: basalt_common::PoolId(pool.parse().ok()?),
            index: u32::from_str_radix(index, 16).ok()?,
        })
    });
    parsed.with_context(|| {
        format!("{text:?} is not a PG id (POOL.INDEX, the index in hex, as `basalt pg ls` shows)")
    })
}

type ReplicaState = Result<PgReplicaState, String>;

/// Each member's state of `pg`, with the digest of its data, as the map names them. The
/// members are asked at once, so that their answers describe about the same moment (and a
/// PG's data is read back on every replica in parallel).
async fn query_members(map: &ClusterMap, pg: PgId) -> anyhow::Result<Vec<(OsdId, ReplicaState)>> {
    ask_members(map, pg, basalt_osd::daemon::OsdRequest::PgQuery { pg }).await
}

/// Asks every member of `pg`, as the map names them, at once; their answers in that order.
async fn ask_members(
    map: &ClusterMap,
    pg: PgId,
    request: basalt_osd::daemon::OsdRequest,
) -> anyhow::Result<Vec<(OsdId, ReplicaState)>> {
    let entry = map
        .pg(pg)
        .with_context(|| format!("pg {pg} does not exist"))?;
    Ok(ask_osds(map, &entry.members, request).await)
}

/// Asks `osds` at once; their answers in that order.
async fn ask_osds(
    map: &ClusterMap,
    osds: &[OsdId],
    request: basalt_osd::daemon::OsdRequest,
) -> Vec<(OsdId, ReplicaState)> {
    let queries: Vec<_> = osds
        .iter()
        .map(|osd| {
            let (map, osd, request) = (map.clone(), *osd, request.clone());
            let query = tokio::spawn(async move {
                ask_osd(&map, osd, &request, std::time::Duration::from_secs(30)).await
            });
            (osd, query)
        })
        .collect();
    let mut states = Vec::new();
    for (osd, query) in queries {
        let state = query
            .await
            .unwrap_or_else(|error| Err(format!("the query failed: {error}")));
        states.push((osd, state));
    }
    states
}

/// OSDs as a list for people: `osd.1, osd.3`.
fn osd_names<'a>(osds: impl IntoIterator<Item = &'a OsdId>) -> String {
    let names: Vec<String> = osds.into_iter().map(ToString::to_string).collect();
    names.join(", ")
}

/// Asks every member of a PG to give up the raft log entries it cannot send
/// (`basalt pg mark-unfound-lost`); fails unless one did.
pub fn run_pg_mark_unfound_lost(
    cluster: ClusterArgs,
    pg: String,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    let pg = parse_pg(&pg)?;
    block_on(async move {
        let map = mon.map().await?;
        let request = basalt_osd::daemon::OsdRequest::MarkUnfoundLost { pg };
        let answers = ask_members(&map, pg, request).await?;
        let gave_up = answers.iter().any(|(_, answer)| answer.is_ok());
        if json {
            print_json(&json!(
                answers
                    .iter()
                    .map(|(osd, answer)| match answer {
                        Ok(state) => json!({
                            "osd": osd.0, "giving_up_from": state.giving_up_from,
                            "last_index": state.last_index, "committed": state.committed,
                        }),
                        Err(error) => json!({"osd": osd.0, "error": error}),
                    })
                    .collect::<Vec<_>>()
            ));
        } else {
            for (osd, answer) in &answers {
                match answer {
                    Ok(state) => println!(
                        "{osd}: gives up the entries of pg {pg} from {} to {} (committed up \
                         to {}): a leader among the others replaces them",
                        state
                            .giving_up_from
                            .map_or("?".to_string(), |i| i.to_string()),
                        state.last_index,
                        state.committed
                    ),
                    Err(error) => println!("{osd}: {error}"),
                }
            }
        }
        if !gave_up {
            let why: Vec<String> = answers
                .iter()
                .filter_map(|(osd, answer)| Some(format!("{osd}: {}", answer.as_ref().err()?)))
                .collect();
            anyhow::bail!("no replica of pg {pg} gave entries up ({})", why.join("; "));
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// The replicas of `pg` that can be asked: the map's members, then every OSD their raft
/// configurations name (a PG whose members moved keeps its old voters until a leader
/// moves it), but those removed from the cluster; each one's cheap state (no digest).
async fn ask_replicas(map: &ClusterMap, pg: PgId) -> anyhow::Result<BTreeMap<OsdId, ReplicaState>> {
    use basalt_osd::daemon::OsdRequest;
    let entry = map
        .pg(pg)
        .with_context(|| format!("pg {pg} does not exist"))?;
    let mut answers: BTreeMap<OsdId, ReplicaState> = BTreeMap::new();
    let removed = |osd: &OsdId| map.removed.contains_key(osd);
    let mut to_ask: Vec<OsdId> = entry
        .members
        .iter()
        .copied()
        .filter(|o| !removed(o))
        .collect();
    while !to_ask.is_empty() {
        answers.extend(ask_osds(map, &to_ask, OsdRequest::PgConf { pg }).await);
        let named: BTreeSet<OsdId> = answers
            .values()
            .filter_map(|answer| answer.as_ref().ok())
            .filter(|state| state.hosted)
            .flat_map(|state| [&state.voters, &state.voters_outgoing, &state.learners])
            .flatten()
            .filter(|osd| !answers.contains_key(osd) && !removed(osd))
            .copied()
            .collect();
        to_ask = named.into_iter().collect();
    }
    Ok(answers)
}

/// Which replica of `pg` `basalt pg force-quorum` makes the only voter, and the voters
/// lost, from the answers of the replicas the map and their configurations name
/// ([`ask_replicas`]) and the OSDs removed from the cluster. Refused if a replica leads, if
/// no voter was removed, or if an OSD a configuration names (voter or learner: a learner
/// holds entries committed too) did not answer and was not removed: the one chosen, with
/// the most up-to-date log (last term, then last index; a voter before a learner), must
/// hold every entry any survivor holds committed.
fn choose_forced(
    pg: PgId,
    answers: &BTreeMap<OsdId, ReplicaState>,
    removed: impl Fn(&OsdId) -> bool,
) -> Result<(OsdId, Vec<OsdId>), String> {
    let hosted: Vec<&PgReplicaState> = answers
        .values()
        .filter_map(|answer| answer.as_ref().ok())
        .filter(|state| state.hosted)
        .collect();
    // (A learner names the last leader it heard for good: only a leader's word counts.)
    if let Some(leader) = hosted.iter().find(|state| state.leader == Some(state.osd)) {
        return Err(format!(
            "pg {pg} has a leader ({}): its voters make a quorum",
            leader.osd
        ));
    }
    let voters: BTreeSet<OsdId> = hosted
        .iter()
        .flat_map(|state| state.voters.iter().chain(&state.voters_outgoing))
        .copied()
        .collect();
    if voters.is_empty() {
        return Err(format!("no OSD that answered hosts a replica of pg {pg}"));
    }
    let lost: Vec<OsdId> = voters.iter().filter(|osd| removed(osd)).copied().collect();
    if lost.is_empty() {
        return Err(format!(
            "no voter of pg {pg} ({}) was removed from the cluster: this is for voters lost \
             for good; mark them out (`basalt osd out ID`) and remove them (`basalt osd rm \
             ID`) first",
            osd_names(&voters)
        ));
    }
    // The newest configuration a replica applied may not leave the voters not removed a
    // quorum: a leader could be elected under it. (An older one cannot elect any more: a
    // quorum of it committed the change after it.)
    let newest = hosted
        .iter()
        .map(|state| state.conf_index)
        .max()
        .unwrap_or(0);
    if let Some(state) = hosted.iter().find(|state| {
        state.conf_index == newest
            && quorum_without(&state.voters, &state.voters_outgoing, &removed)
    }) {
        return Err(format!(
            "the voters of pg {pg} as {} applied them (voters [{}], outgoing [{}]) make a \
             quorum without those removed: they can elect a leader",
            state.osd,
            osd_names(&state.voters),
            osd_names(&state.voters_outgoing)
        ));
    }
    let named: BTreeSet<OsdId> = hosted
        .iter()
        .flat_map(|state| [&state.voters, &state.voters_outgoing, &state.learners])
        .flatten()
        .copied()
        .collect();
    let silent = named.iter().filter(|osd| !removed(osd)).find_map(|osd| {
        let error = match answers.get(osd) {
            Some(Err(error)) => error.clone(),
            Some(Ok(_)) => return None,
            None => "not asked".to_string(),
        };
        Some((osd, error))
    });
    if let Some((osd, error)) = silent {
        return Err(format!(
            "{osd}, a member of pg {pg}, did not answer ({error}): bring it back, or if its \
             device is lost for good remove it (`basalt osd out {id}`, `basalt osd rm {id}`) \
             first (the replica made the only voter must be the one with the most of the log)",
            id = osd.0
        ));
    }
    let best = hosted
        .iter()
        .max_by_key(|state| (state.last_term, state.last_index, state.votes(state.osd)))
        .map(|state| state.osd)
        .ok_or_else(|| format!("no surviving replica of pg {pg} answered"))?;
    Ok((best, lost))
}

/// Makes the surviving replica of a PG with the most of its raft log (last term, then last
/// index) the PG's only voter, when the voters removed from the cluster (lost for good)
/// leave it no quorum (`basalt pg force-quorum`). Every other voter must answer, so that
/// the one chosen holds every entry any survivor holds committed.
pub fn run_pg_force_quorum(
    cluster: ClusterArgs,
    pg: String,
    json: bool,
) -> anyhow::Result<ExitCode> {
    use basalt_osd::daemon::OsdRequest;
    let mon = cluster.client()?;
    let pg = parse_pg(&pg)?;
    block_on(async move {
        let map = mon.map().await?;
        let answers = ask_replicas(&map, pg).await?;
        let removed = |osd: &OsdId| map.removed.contains_key(osd);
        let (best, lost) = choose_forced(pg, &answers, removed).map_err(anyhow::Error::msg)?;
        let request = OsdRequest::ForceQuorum {
            pg,
            lost: lost.clone(),
        };
        let within = std::time::Duration::from_secs(30);
        let state = ask_osd(&map, best, &request, within)
            .await
            .map_err(|error| anyhow::anyhow!("{best}: {error}"))?;
        // It elects itself once it has applied its log.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let mut leads = false;
        while !leads && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let request = OsdRequest::PgConf { pg };
            leads = ask_osd(&map, best, &request, within)
                .await
                .is_ok_and(|now| now.leader == Some(best));
        }
        if json {
            print_json(&json!({
                "pg": pg.to_string(), "osd": best.0, "lost": lost.iter().map(|o| o.0).collect::<Vec<_>>(),
                "last_index": state.last_index, "last_term": state.last_term, "leads": leads,
            }));
        } else {
            println!(
                "{}: the only voter of pg {pg} now, its raft log kept up to {} (term {}); voters \
                 lost: {}",
                best,
                state.last_index,
                state.last_term,
                osd_names(&lost)
            );
            let members = map.pg(pg).map(|entry| osd_names(&entry.members));
            println!(
                "it {} and moves the PG to its members ({}) as it does any",
                if leads {
                    "leads"
                } else {
                    "has not been elected yet"
                },
                members.unwrap_or_default()
            );
        }
        if !leads {
            anyhow::bail!("{} was not elected within 30 s", best);
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// Asks every member of a PG for its replica's state.
pub fn run_pg_query(cluster: ClusterArgs, pg: String, json: bool) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    let pg = parse_pg(&pg)?;
    block_on(async move {
        let map = mon.map().await?;
        let states = query_members(&map, pg).await?;
        if json {
            print_json(&json!(
                states
                    .iter()
                    .map(|(osd, state)| match state {
                        Ok(state) => serde_json::to_value(state).expect("states serialise"),
                        Err(error) => json!({"osd": osd.0, "error": error}),
                    })
                    .collect::<Vec<_>>()
            ));
        } else {
            println!(
                "{:<8} {:<8} {:>6} {:>10} {:>10} {:>10} {:>8} {:>10}  VOTERS",
                "OSD", "LEADER", "TERM", "COMMITTED", "APPLIED", "LAST", "OBJECTS", "DIGEST"
            );
            for (osd, state) in &states {
                match state {
                    Ok(s) => println!(
                        "{:<8} {:<8} {:>6} {:>10} {:>10} {:>10} {:>8} {:>10}  {}",
                        osd.to_string(),
                        s.leader.map_or("-".to_string(), |l| l.0.to_string()),
                        s.term,
                        s.committed,
                        s.applied,
                        s.last_index,
                        s.objects,
                        format!("{:08x}", s.digest),
                        s.voters
                            .iter()
                            .map(|v| v.0.to_string())
                            .collect::<Vec<_>>()
                            .join(",")
                    ),
                    Err(error) => println!("{:<8} unreachable: {error}", osd.to_string()),
                }
            }
            for (osd, state) in &states {
                if let Ok(PgReplicaState {
                    giving_up_from: Some(from),
                    ..
                }) = state
                {
                    println!(
                        "{osd} gives up its entries from {from} (basalt pg mark-unfound-lost)"
                    );
                }
            }
        }
        Ok(ExitCode::SUCCESS)
    })
}

/// What a scrub found in one PG.
#[derive(Debug, PartialEq)]
enum Scrubbed {
    /// Every replica holds the same data (their digest).
    Consistent(u32),
    /// Some replicas differ from the others: each OSD's digest, and those in the minority
    /// (every replica if no digest has a majority).
    Inconsistent {
        digests: Vec<(OsdId, u32)>,
        odd: Vec<OsdId>,
    },
    /// Not compared, and why (a replica did not answer, or they kept applying writes).
    NotCompared(String),
}

/// Compares the replicas' states of one PG: only states at the same applied index say
/// anything (`None`: ask again).
fn compare(states: &[(OsdId, ReplicaState)]) -> Option<Scrubbed> {
    let mut answered = Vec::new();
    for (osd, state) in states {
        match state {
            Ok(state) if !state.hosted => {
                return Some(Scrubbed::NotCompared(format!("{osd} does not host it")));
            }
            Ok(state) => answered.push((*osd, state)),
            Err(error) => {
                return Some(Scrubbed::NotCompared(format!(
                    "{osd} did not answer: {error}"
                )));
            }
        }
    }
    let Some((_, first)) = answered.first() else {
        return Some(Scrubbed::NotCompared("the PG has no members".to_string()));
    };
    if answered
        .iter()
        .any(|(_, state)| state.applied != first.applied)
    {
        return None;
    }
    let digests: Vec<(OsdId, u32)> = answered
        .iter()
        .map(|(osd, state)| (*osd, state.digest))
        .collect();
    let odd = odd_replicas(&digests);
    if odd.is_empty() {
        return Some(Scrubbed::Consistent(first.digest));
    }
    Some(Scrubbed::Inconsistent { digests, odd })
}

/// Compares the replicas of `pg` now, asking again while they are at different log
/// entries (writes under way).
async fn scrub_pg(mon: &MonClient, pg: PgId) -> anyhow::Result<Scrubbed> {
    const ATTEMPTS: u32 = 20;
    for attempt in 0..ATTEMPTS {
        let map = mon.map().await?;
        let result = match query_members(&map, pg).await {
            Ok(states) => compare(&states),
            // Named but not in the map, or removed with its pool meanwhile: reported with
            // the others, not the end of the scrub.
            Err(error) => Some(Scrubbed::NotCompared(error.to_string())),
        };
        if let Some(result) = result {
            return Ok(result);
        }
        if attempt + 1 < ATTEMPTS {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    Ok(Scrubbed::NotCompared(format!(
        "its replicas were at different log entries in {ATTEMPTS} queries (writes under \
         way); scrub it again"
    )))
}

/// Compares the data of each PG's replicas (every PG if `pgs` is empty): each replica reads
/// all of its PG's data back from its device and digests it, and replicas that applied the
/// same log entries must agree. Fails if any PG is inconsistent or could not be compared.
pub fn run_pg_scrub(
    cluster: ClusterArgs,
    pgs: Vec<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    let mut wanted = pgs
        .iter()
        .map(|pg| parse_pg(pg))
        .collect::<anyhow::Result<Vec<PgId>>>()?;
    block_on(async move {
        let map = mon.map().await?;
        if wanted.is_empty() {
            for pool in map.pools.values() {
                wanted.extend((0..pool.pgs.len() as u32).map(|index| PgId {
                    pool: pool.id,
                    index,
                }));
            }
        }
        let mut results = Vec::new();
        for pg in wanted {
            results.push((pg, scrub_pg(&mon, pg).await?));
        }
        let consistent = results
            .iter()
            .filter(|(_, result)| matches!(result, Scrubbed::Consistent(_)))
            .count();
        let inconsistent = results
            .iter()
            .filter(|(_, result)| matches!(result, Scrubbed::Inconsistent { .. }))
            .count();
        let not_compared = results.len() - consistent - inconsistent;
        if json {
            print_json(&json!(
                results
                    .iter()
                    .map(|(pg, result)| match result {
                        Scrubbed::Consistent(digest) => json!({
                            "pg": pg.to_string(), "state": "consistent",
                            "digest": format!("{digest:08x}"),
                        }),
                        Scrubbed::Inconsistent { digests, odd } => json!({
                            "pg": pg.to_string(), "state": "inconsistent",
                            "digests": digests.iter()
                                .map(|(osd, digest)| json!({"osd": osd.0, "digest": format!("{digest:08x}")}))
                                .collect::<Vec<_>>(),
                            "odd": odd.iter().map(|osd| osd.0).collect::<Vec<_>>(),
                        }),
                        Scrubbed::NotCompared(why) => json!({
                            "pg": pg.to_string(), "state": "not compared", "why": why,
                        }),
                    })
                    .collect::<Vec<_>>()
            ));
        } else {
            for (pg, result) in &results {
                match result {
                    Scrubbed::Consistent(digest) => {
                        println!("{:<10} consistent (digest {digest:08x})", pg.to_string());
                    }
                    Scrubbed::Inconsistent { digests, odd } => println!(
                        "{:<10} INCONSISTENT: {} differ{} ({})",
                        pg.to_string(),
                        odd.iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                        if odd.len() == 1 { "s" } else { "" },
                        digests
                            .iter()
                            .map(|(osd, digest)| format!("{osd} {digest:08x}"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    Scrubbed::NotCompared(why) => {
                        println!("{:<10} not compared: {why}", pg.to_string());
                    }
                }
            }
            println!(
                "{consistent} pgs consistent, {inconsistent} inconsistent, {not_compared} not compared"
            );
        }
        Ok(if inconsistent + not_compared == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    })
}

/// What `basalt pg repair` did to one PG.
#[derive(Debug)]
enum Repair {
    /// Its replicas agreed: nothing to do.
    Consistent,
    /// These replicas were rebuilt from the leader, and a scrub at this log index found
    /// every replica equal.
    Done { osds: Vec<OsdId>, marker: u64 },
    /// Not repaired, or not confirmed, and why.
    Failed(String),
}

/// The replicas of `pg` to rebuild: `chosen`, else those that differ from the majority, as
/// the latest background scrub found or else as a scrub now finds (`Err`: the repair
/// cannot go on).
async fn odd_replicas_of(
    mon: &MonClient,
    status: &ClusterStatus,
    pg: PgId,
    chosen: Option<OsdId>,
) -> anyhow::Result<Result<Vec<OsdId>, String>> {
    let Some(entry) = status.map.pg(pg) else {
        return Ok(Err(format!("pg {pg} does not exist")));
    };
    let members = entry.members.clone();
    let background = inconsistent_pgs(&status.reports, [(pg, members.clone())])
        .into_iter()
        .next()
        .map(|(_, odd)| odd);
    if let Some(osd) = chosen {
        let others: Vec<String> = background
            .iter()
            .flatten()
            .filter(|odd| **odd != osd)
            .map(ToString::to_string)
            .collect();
        return Ok(if !members.contains(&osd) {
            Err(format!("{osd} holds no replica of pg {pg}"))
        } else if members.len() < 2 {
            Err(format!(
                "{osd} holds the only replica of pg {pg}: nothing to rebuild it from"
            ))
        } else if !others.is_empty() {
            // The copy it would get could be one of theirs.
            Err(format!(
                "the last scrub found {} differing from the others: repair without --osd",
                others.join(", ")
            ))
        } else {
            Ok(vec![osd])
        });
    }
    let odd = match background {
        Some(odd) => odd,
        None => match scrub_pg(mon, pg).await? {
            Scrubbed::Consistent(_) => Vec::new(),
            Scrubbed::Inconsistent { odd, .. } => odd,
            Scrubbed::NotCompared(why) => return Ok(Err(format!("not compared: {why}"))),
        },
    };
    if !odd.is_empty() && odd.len() * 2 >= members.len() {
        let odd: Vec<String> = odd.iter().map(ToString::to_string).collect();
        return Ok(Err(format!(
            "no majority of its {} replicas agree ({} differ): which copy is good cannot be told",
            members.len(),
            odd.join(", ")
        )));
    }
    Ok(Ok(odd))
}

/// Sends `request` to OSD `osd` of `map`, which answers with the replica's state.
async fn ask_osd(
    map: &ClusterMap,
    osd: OsdId,
    request: &basalt_osd::daemon::OsdRequest,
    answer_within: std::time::Duration,
) -> ReplicaState {
    ask_osd_for(map, osd, request, answer_within).await
}

/// Sends `request` to OSD `osd` of `map`, which answers with a `T`.
async fn ask_osd_for<T: serde::de::DeserializeOwned>(
    map: &ClusterMap,
    osd: OsdId,
    request: &basalt_osd::daemon::OsdRequest,
    answer_within: std::time::Duration,
) -> Result<T, String> {
    let address = map
        .osds
        .get(&osd)
        .and_then(|entry| entry.address.parse::<std::net::SocketAddr>().ok())
        .ok_or_else(|| format!("{osd} has no address in the map"))?;
    basalt_osd::daemon::ask_osd(address, request, answer_within).await
}

/// Repairs one PG: rebuilds its odd replicas from the leader, puts a scrub marker in its
/// log, and waits for every member's digest of it.
async fn repair_pg(mon: &MonClient, pg: PgId, chosen: Option<OsdId>) -> anyhow::Result<Repair> {
    use basalt_osd::daemon::{OsdRequest, REPAIR_ANSWER_WITHIN};
    let status = mon.status().await?;
    let odd = match odd_replicas_of(mon, &status, pg, chosen).await? {
        Ok(odd) if odd.is_empty() => return Ok(Repair::Consistent),
        Ok(odd) => odd,
        Err(why) => return Ok(Repair::Failed(why)),
    };
    let map = status.map;
    // The OSD answers within REPAIR_ANSWER_WITHIN, repaired or not.
    let answer_within = REPAIR_ANSWER_WITHIN + std::time::Duration::from_secs(30);
    let repairs: Vec<_> = odd
        .iter()
        .map(|osd| {
            let (map, osd, avoid) = (map.clone(), *osd, odd.clone());
            tokio::spawn(async move {
                let request = OsdRequest::Repair { pg, avoid };
                ask_osd(&map, osd, &request, answer_within).await
            })
        })
        .collect();
    for (osd, repair) in odd.iter().zip(repairs) {
        let answer = repair
            .await
            .unwrap_or_else(|error| Err(format!("the request failed: {error}")));
        if let Err(error) = answer {
            return Ok(Repair::Failed(format!("{osd} not repaired: {error}")));
        }
    }
    let members = map
        .pg(pg)
        .map(|entry| entry.members.clone())
        .unwrap_or_default();
    let marker = match propose_marker(&map, pg, &members).await {
        Ok(marker) => marker,
        Err(refusals) => {
            return Ok(Repair::Failed(format!(
                "repaired, but no member put a scrub marker in its log to confirm it: {refusals}"
            )));
        }
    };
    // Every member's digest of the same marker (that one or a later one), from the
    // reports the monitors hold. A replica does not digest a marker its objects may be
    // fuzzy at (a snapshot it installed since, if it fell behind under writes): another
    // marker is asked for every few seconds until all digest one.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut asked_again = std::time::Instant::now();
    loop {
        let scrubs = member_scrubs(&mon.status().await?.reports, pg, &members);
        let same = scrubs.len() == members.len()
            && scrubs
                .iter()
                .all(|(_, scrub)| scrub.index >= marker && scrub.index == scrubs[0].1.index);
        if same {
            let digests: Vec<(OsdId, u32)> = scrubs
                .iter()
                .map(|(osd, scrub)| (*osd, scrub.digest))
                .collect();
            let still = odd_replicas(&digests);
            if still.is_empty() {
                return Ok(Repair::Done {
                    osds: odd,
                    marker: scrubs[0].1.index,
                });
            }
            let still: Vec<String> = still.iter().map(ToString::to_string).collect();
            return Ok(Repair::Failed(format!(
                "repaired, but the scrub at log index {} found {} still differing",
                scrubs[0].1.index,
                still.join(", ")
            )));
        }
        if std::time::Instant::now() > deadline {
            return Ok(Repair::Failed(format!(
                "repaired, but not every member reported a scrub at log index {marker} or \
                 later within 60 s (`basalt pg scrub` compares them now)"
            )));
        }
        if asked_again.elapsed() > std::time::Duration::from_secs(5) {
            asked_again = std::time::Instant::now();
            // Not confirmed if refused: the markers already asked for may yet do.
            let _ = propose_marker(&map, pg, &members).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// Has the leader of `pg` put a scrub marker in its log now (asking each member, a few
/// times: the leader may be moving); the marker's index, or why none was.
async fn propose_marker(map: &ClusterMap, pg: PgId, members: &[OsdId]) -> Result<u64, String> {
    let mut refusals = Vec::new();
    for _ in 0..50 {
        refusals.clear();
        for osd in members {
            let request = basalt_osd::daemon::OsdRequest::Scrub { pg };
            match ask_osd(map, *osd, &request, std::time::Duration::from_secs(5)).await {
                Ok(state) => return Ok(state.last_index),
                Err(error) => refusals.push(error),
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    Err(refusals.join("; "))
}

/// Repairs each PG named (see [`repair_pg`]): its replica on `osd` if given.
pub fn run_pg_repair(
    cluster: ClusterArgs,
    pgs: Vec<String>,
    osd: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mon = cluster.client()?;
    let wanted = pgs
        .iter()
        .map(|pg| parse_pg(pg))
        .collect::<anyhow::Result<Vec<PgId>>>()?;
    let chosen = osd.as_deref().map(parse_osd_id).transpose()?;
    // A few PGs at once: the copies and the scrubs that confirm them overlap (an OSD
    // installs at most `--max-moves` snapshots at once, 4 by default, and refuses more
    // for now).
    const AT_ONCE: usize = 4;
    let mon = std::sync::Arc::new(mon);
    block_on(async move {
        let mut results = Vec::with_capacity(wanted.len());
        for group in wanted.chunks(AT_ONCE) {
            let tasks: Vec<_> = group
                .iter()
                .map(|pg| {
                    let (mon, pg) = (mon.clone(), *pg);
                    tokio::spawn(async move {
                        // A monitor that fails to answer fails this PG's repair, not the others'.
                        repair_pg(&mon, pg, chosen)
                            .await
                            .unwrap_or_else(|error| Repair::Failed(format!("{error:#}")))
                    })
                })
                .collect();
            for (pg, task) in group.iter().zip(tasks) {
                results.push((*pg, task.await.context("a repair task failed")?));
            }
        }
        let failed = results
            .iter()
            .filter(|(_, result)| matches!(result, Repair::Failed(_)))
            .count();
        if json {
            print_json(&json!(
                results
                    .iter()
                    .map(|(pg, result)| match result {
                        Repair::Consistent => json!({"pg": pg.to_string(), "state": "consistent"}),
                        Repair::Done { osds, marker } => json!({
                            "pg": pg.to_string(), "state": "repaired",
                            "repaired": osds.iter().map(|osd| osd.0).collect::<Vec<_>>(),
                            "scrubbed_at": marker,
                        }),
                        Repair::Failed(why) => json!({
                            "pg": pg.to_string(), "state": "failed", "why": why,
                        }),
                    })
                    .collect::<Vec<_>>()
            ));
        } else {
            for (pg, result) in &results {
                let pg = pg.to_string();
                match result {
                    Repair::Consistent => {
                        println!("{pg:<10} consistent: nothing to repair");
                    }
                    Repair::Done { osds, marker } => println!(
                        "{pg:<10} repaired: {} rebuilt from the leader; the scrub at log index \
                         {marker} found every replica equal",
                        osds.iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    Repair::Failed(why) => println!("{pg:<10} NOT REPAIRED: {why}"),
                }
            }
        }
        Ok(if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Calls cover the ranges in order, each at most a step, and only the last is short.
    #[test]
    fn ranges_are_cut_into_calls_of_a_step_at_most() {
        let calls = steps_of(&[0..3, 5..12, 20..21], 4);
        assert_eq!(
            calls,
            vec![vec![0..3, 5..6], vec![6..10], vec![10..12, 20..21]]
        );
        let whole = 0..8;
        let calls = steps_of(std::slice::from_ref(&whole), 4);
        assert_eq!(calls, vec![vec![0..4], vec![4..8]]);
        assert!(steps_of(&[], 4).is_empty());
    }

    /// Health names a PG without a leader whose member reports raft log entries it cannot
    /// send, with the command; not an active PG, nor a report from a non-member.
    #[test]
    fn health_names_inactive_pgs_with_entries_a_replica_cannot_send() {
        let pg = |index| PgId {
            pool: basalt_common::PoolId(1),
            index,
        };
        let unsendable = |pgs: Vec<PgId>| basalt_mon::protocol::OsdReport {
            unsendable: pgs,
            ..Default::default()
        };
        let status = status_of(
            ClusterMap::new(),
            vec![
                (OsdId(1), unsendable(vec![pg(0), pg(1)])),
                (OsdId(9), unsendable(vec![pg(2)])),
            ],
        );
        let members = vec![OsdId(1), OsdId(2)];
        let states = vec![
            (pg(0), members.clone(), None, "inactive"),
            (pg(1), members.clone(), Some(OsdId(2)), "active+clean"),
            (pg(2), members, None, "inactive"),
        ];
        let (warnings, _) = health(&status, &states);
        let named: Vec<&String> = warnings
            .iter()
            .filter(|w| w.contains("cannot send"))
            .collect();
        assert_eq!(named.len(), 1, "{warnings:?}");
        assert!(
            named[0].starts_with(
                "1 pgs inactive with raft log entries a replica cannot send: pg 1.0 (osd.1)"
            ) && named[0].contains("basalt pg mark-unfound-lost"),
            "{warnings:?}"
        );
    }

    /// Health names the monitors out of the leader's quorum (Ceph's MON_DOWN); nothing
    /// when all are in, nor when the leader tells no quorum (an older version).
    #[test]
    fn health_names_monitors_out_of_quorum() {
        let names = |list: &[&str]| list.iter().map(ToString::to_string).collect::<Vec<_>>();
        let mut status = status_of(ClusterMap::new(), Vec::new());
        status.monitors = names(&["a:1", "b:2", "c:3"]);
        let monitor_warnings = |status: &basalt_mon::protocol::ClusterStatus| {
            let (warnings, error) = health(status, &[]);
            assert!(!error);
            warnings
                .into_iter()
                .filter(|warning| warning.contains("monitors"))
                .collect::<Vec<_>>()
        };
        status.quorum = names(&["a:1", "c:3"]);
        assert_eq!(
            monitor_warnings(&status),
            vec!["1/3 monitors out of quorum: b:2 (quorum a:1,c:3)".to_string()]
        );
        status.quorum = names(&["a:1", "b:2", "c:3"]);
        assert!(monitor_warnings(&status).is_empty());
        status.quorum = Vec::new();
        assert!(monitor_warnings(&status).is_empty());
    }

    /// A cluster's status with this map and these reports, and no client load.
    fn status_of(
        map: ClusterMap,
        reports: Vec<(OsdId, basalt_mon::protocol::OsdReport)>,
    ) -> basalt_mon::protocol::ClusterStatus {
        basalt_mon::protocol::ClusterStatus {
            map,
            monitors: Vec::new(),
            quorum: Vec::new(),
            leader: String::new(),
            reports,
            ops_per_second: (0.0, 0.0),
            bytes_per_second: (0.0, 0.0),
        }
    }

    /// Health names the OSDs that keep records of PGs they cannot host (their logs are not
    /// reused), with the PGs; not an OSD that holds none.
    #[test]
    fn health_names_osds_keeping_records_of_pgs_they_cannot_host() {
        let pg = |index| PgId {
            pool: basalt_common::PoolId(2),
            index,
        };
        let held = |pgs: Vec<PgId>| basalt_mon::protocol::OsdReport {
            held: pgs,
            ..Default::default()
        };
        let status = status_of(
            ClusterMap::new(),
            vec![
                (OsdId(1), held(vec![pg(0), pg(3)])),
                (OsdId(2), held(Vec::new())),
            ],
        );
        let (warnings, error) = health(&status, &[]);
        let named: Vec<&String> = warnings
            .iter()
            .filter(|w| w.contains("cannot host"))
            .collect();
        assert_eq!(named.len(), 1, "{warnings:?}");
        assert!(
            named[0].starts_with("1 osds keep records of pgs they cannot host")
                && named[0].ends_with(": osd.1 (pg 2.0, 2.3)"),
            "{warnings:?}"
        );
        assert!(!error);
    }

    /// Health names an inactive PG whose voters removed from the cluster leave no quorum,
    /// with the command; not one whose other voters make a quorum, nor an active one.
    #[test]
    fn health_names_inactive_pgs_whose_removed_voters_leave_no_quorum() {
        use basalt_mon::protocol::{LeaderlessPg, OsdReport};
        let pg = |index| PgId {
            pool: basalt_common::PoolId(1),
            index,
        };
        let leaderless = |index, voters: &[u32]| LeaderlessPg {
            pg: pg(index),
            voters: voters.iter().map(|id| OsdId(*id)).collect(),
            voters_outgoing: Vec::new(),
        };
        let mut map = ClusterMap::new();
        map.removed.insert(OsdId(2), "uuid".to_string());
        let report = OsdReport {
            leaderless: vec![
                leaderless(0, &[1, 2]),
                leaderless(1, &[1, 2, 3]),
                leaderless(2, &[1, 2]),
            ],
            ..Default::default()
        };
        let status = status_of(map, vec![(OsdId(1), report)]);
        let members = vec![OsdId(1), OsdId(3)];
        let states = vec![
            (pg(0), members.clone(), None, "inactive"),
            (pg(1), members.clone(), None, "inactive"),
            (pg(2), members, Some(OsdId(1)), "active+clean"),
        ];
        let (warnings, _) = health(&status, &states);
        let named: Vec<&String> = warnings
            .iter()
            .filter(|w| w.contains("leave no quorum"))
            .collect();
        assert_eq!(named.len(), 1, "{warnings:?}");
        assert!(
            named[0].starts_with(
                "1 pgs inactive whose voters removed from the cluster leave no quorum: pg 1.0 \
                 (removed osd.2)"
            ) && named[0].contains("basalt pg force-quorum"),
            "{warnings:?}"
        );
    }

    /// force-quorum chooses the replica with the most up-to-date log among every
    /// member's, refuses while a member that was not removed is silent (a learner too),
    /// while a replica leads, or while no voter was removed.
    #[test]
    fn force_quorum_chooses_the_most_up_to_date_replica_once_every_member_answered() {
        let pg = PgId {
            pool: basalt_common::PoolId(1),
            index: 0,
        };
        // Voters 0, 1 and 2, learner 3.
        let replica = |osd: u32, last_term: u64, last_index: u64| {
            let (id, state) = state(osd, last_index, 0);
            let mut state = state.expect("a state");
            state.leader = None;
            state.last_term = last_term;
            state.voters = vec![OsdId(0), OsdId(1), OsdId(2)];
            state.learners = vec![OsdId(3)];
            (id, Ok(state))
        };
        let removed = |osd: &OsdId| [OsdId(0), OsdId(2)].contains(osd);
        let mut answers: BTreeMap<OsdId, ReplicaState> =
            [replica(1, 3, 90), replica(3, 3, 100)].into();
        // The learner holds entries the voter lacks: it is the one.
        assert_eq!(
            choose_forced(pg, &answers, removed),
            Ok((OsdId(3), vec![OsdId(0), OsdId(2)]))
        );
        // Of the same log, the voter.
        answers.insert(OsdId(1), replica(1, 3, 100).1);
        assert_eq!(
            choose_forced(pg, &answers, removed).map(|c| c.0),
            Ok(OsdId(1))
        );
        // A later term counts before a longer log.
        answers.insert(OsdId(1), replica(1, 4, 50).1);
        assert_eq!(
            choose_forced(pg, &answers, removed).map(|c| c.0),
            Ok(OsdId(1))
        );
        // A silent learner may hold more: refused.
        answers.insert(OsdId(3), Err("connection refused".to_string()));
        let refused = choose_forced(pg, &answers, removed).expect_err("refused");
        assert!(
            refused.starts_with("osd.3, a member of pg 1.0, did not answer"),
            "{refused}"
        );
        answers.remove(&OsdId(3));
        let refused = choose_forced(pg, &answers, removed).expect_err("refused");
        assert!(refused.contains("not asked"), "{refused}");
        // Unless it was removed too.
        let gone = |osd: &OsdId| removed(osd) || *osd == OsdId(3);
        assert_eq!(choose_forced(pg, &answers, gone).map(|c| c.0), Ok(OsdId(1)));
        // No voter removed, or a leader: refused.
        let refused = choose_forced(pg, &answers, |_| false).expect_err("refused");
        assert!(
            refused.contains("was removed from the cluster"),
            "{refused}"
        );
        // A replica that applied a configuration with a quorum left: refused.
        let mut moved = replica(3, 3, 40).1.expect("a state");
        moved.voters = vec![OsdId(1), OsdId(3), OsdId(0)];
        moved.conf_index = 30;
        answers.insert(OsdId(3), Ok(moved));
        let refused = choose_forced(pg, &answers, removed).expect_err("refused");
        assert!(
            refused.starts_with(
                "the voters of pg 1.0 as osd.3 applied them (voters [osd.1, osd.3, osd.0]"
            ),
            "{refused}"
        );
        // Unless another applied a newer one.
        let mut newer = replica(1, 4, 50).1.expect("a state");
        newer.conf_index = 35;
        answers.insert(OsdId(1), Ok(newer));
        assert_eq!(
            choose_forced(pg, &answers, removed).map(|c| c.0),
            Ok(OsdId(1))
        );
        answers.remove(&OsdId(3));
        let mut leading = replica(1, 4, 50).1.expect("a state");
        leading.leader = Some(OsdId(1));
        answers.insert(OsdId(1), Ok(leading));
        let refused = choose_forced(pg, &answers, gone).expect_err("refused");
        assert!(refused.contains("has a leader (osd.1)"), "{refused}");
    }

    fn state(osd: u32, applied: u64, digest: u32) -> (OsdId, ReplicaState) {
        let state = PgReplicaState {
            osd: OsdId(osd),
            pg: PgId {
                pool: basalt_common::PoolId(1),
                index: 0,
            },
            hosted: true,
            leader: Some(OsdId(0)),
            term: 2,
            committed: applied,
            applied,
            last_index: applied,
            last_term: 2,
            objects: 1,
            mapped_bytes: 4096,
            digest,
            voters: vec![OsdId(0), OsdId(1), OsdId(2)],
            voters_outgoing: Vec::new(),
            learners: Vec::new(),
            conf_index: 0,
            giving_up_from: None,
            voters_matched: None,
        };
        (OsdId(osd), Ok(state))
    }

    #[test]
    fn replicas_are_compared_only_at_the_same_applied_entry() {
        assert_eq!(
            compare(&[state(0, 9, 7), state(1, 9, 7), state(2, 9, 7)]),
            Some(Scrubbed::Consistent(7))
        );
        // Different data at different entries says nothing: ask again.
        assert_eq!(
            compare(&[state(0, 9, 7), state(1, 8, 6), state(2, 9, 7)]),
            None
        );
        assert_eq!(
            compare(&[state(0, 9, 7), state(1, 9, 6), state(2, 9, 7)]),
            Some(Scrubbed::Inconsistent {
                digests: vec![(OsdId(0), 7), (OsdId(1), 6), (OsdId(2), 7)],
                odd: vec![OsdId(1)],
            })
        );
        // No majority: every replica is named.
        let Some(Scrubbed::Inconsistent { odd, .. }) = compare(&[state(0, 9, 7), state(1, 9, 6)])
        else {
            panic!("two replicas that differ are inconsistent");
        };
        assert_eq!(odd, vec![OsdId(0), OsdId(1)]);
        let mut unhosted = state(2, 9, 7);
        if let Ok(state) = &mut unhosted.1 {
            state.hosted = false;
        }
        assert!(matches!(
            compare(&[state(0, 9, 7), unhosted]),
            Some(Scrubbed::NotCompared(why)) if why.contains("osd.2 does not host it")
        ));
        assert!(matches!(
            compare(&[state(0, 9, 7), (OsdId(1), Err("refused".to_string()))]),
            Some(Scrubbed::NotCompared(why)) if why.contains("osd.1 did not answer: refused")
        ));
    }
}
