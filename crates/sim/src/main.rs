//! `cargo run -p basalt-sim -- --seed N [--steps S] [--osds N --pgs N --faults X]
//! [--members N] [--loss P] [--delay D] [--damage P] [--lose-osd]`: replays one simulation
//! run.
//! `--osds`, `--pgs` and `--faults` make a harsher run than CI's seeds
//! ([`basalt_sim::SimConfig::harsher`]); `--members` sets the replicas per PG, `--loss` the
//! chance that a message is lost, `--delay` the longest delay of one, in steps, and
//! `--damage` the chance per step of damage to a copy (after `--faults`), and `--lose-osd`
//! loses an OSD for good halfway ([`basalt_sim::SimConfig::lose_osd`]); for sweeps by
//! hand. A failure names the
//! flags given, to replay it, and `BASALT_SIM_STATE=1` describes every replica then.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let number = |flag: &str| value(flag).and_then(|v| v.parse::<u64>().ok());
    let Some(seed) = number("--seed") else {
        eprintln!(
            "usage: basalt-sim --seed N [--steps S] [--osds N --pgs N --faults X] [--members N] \
             [--loss P] [--delay D] [--damage P] [--lose-osd]"
        );
        return ExitCode::FAILURE;
    };
    let mut config = basalt_sim::SimConfig::new(seed);
    if let Some(steps) = number("--steps") {
        config.steps = steps;
    }
    if let Some(faults) = value("--faults").and_then(|v| v.parse::<f64>().ok()) {
        let osds = number("--osds").map_or(config.osds, |n| n as u32);
        let pgs = number("--pgs").map_or(config.pgs, |n| n as u32);
        config = config.harsher(osds, pgs, faults);
    }
    if let Some(members) = number("--members") {
        config.members = members as u32;
    }
    if let Some(loss) = value("--loss").and_then(|v| v.parse::<f64>().ok()) {
        config.loss = loss;
    }
    if let Some(delay) = number("--delay") {
        config.delay_max = delay;
    }
    if let Some(damage) = value("--damage").and_then(|v| v.parse::<f64>().ok()) {
        config.damage = damage;
    }
    config.lose_osd = args.iter().any(|a| a == "--lose-osd");
    match basalt_sim::run(&config) {
        Ok(outcome) => {
            eprintln!("{outcome:?}");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("{failure} (flags: {})", args[1..].join(" "));
            ExitCode::FAILURE
        }
    }
}
