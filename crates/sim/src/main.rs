//! `cargo run -p basalt-sim -- --seed N [--steps S] [--osds N] [--pgs N] [--faults X]
//! [--members N] [--loss P] [--delay D] [--damage P] [--lose-osd] [--lose-two]`: replays one simulation
//! run. Beyond CI's runs, for sweeps by hand: `--osds` and `--pgs` set the cluster's size
//! and `--faults` multiplies the chances of crashes, partitions, pauses, damage and
//! membership changes ([`basalt_sim::SimConfig::harsher`]); `--members` sets the replicas
//! per PG, `--loss` the chance that a message is lost, `--delay` the longest delay of one
//! in steps, `--damage` the chance per step of damage to a copy (after `--faults`), and
//! `--lose-osd` loses an OSD for good halfway ([`basalt_sim::SimConfig::lose_osd`]),
//! `--lose-two` two at once ([`basalt_sim::SimConfig::lose_two`]). A
//! failure names the flags given, to replay it; `BASALT_SIM_STATE=1` then describes every
//! replica.

use std::process::ExitCode;
use std::str::FromStr;

const USAGE: &str = "usage: basalt-sim --seed N [--steps S] [--osds N] [--pgs N] [--faults X] \
                     [--members N] [--loss P] [--delay D] [--damage P] [--lose-osd] [--lose-two]";

/// The value after `flag` in `args`, if the flag is given; an error names a flag without a
/// value or with one that does not parse.
fn value<T: FromStr>(args: &[String], flag: &str) -> Result<Option<T>, String> {
    let Some(at) = args.iter().position(|a| a == flag) else {
        return Ok(None);
    };
    let text = args.get(at + 1).ok_or(format!("{flag} needs a value"))?;
    text.parse()
        .map(Some)
        .map_err(|_| format!("{flag} {text}: not a valid value"))
}

fn config(args: &[String]) -> Result<basalt_sim::SimConfig, String> {
    let seed = value(args, "--seed")?.ok_or("--seed is required")?;
    let mut config = basalt_sim::SimConfig::new(seed);
    let osds = value(args, "--osds")?.unwrap_or(config.osds);
    let pgs = value(args, "--pgs")?.unwrap_or(config.pgs);
    let faults = value(args, "--faults")?.unwrap_or(1.0);
    config = config.harsher(osds, pgs, faults);
    config.steps = value(args, "--steps")?.unwrap_or(config.steps);
    config.members = value(args, "--members")?.unwrap_or(config.members);
    config.loss = value(args, "--loss")?.unwrap_or(config.loss);
    config.delay_max = value(args, "--delay")?.unwrap_or(config.delay_max);
    config.damage = value(args, "--damage")?.unwrap_or(config.damage);
    config.lose_osd = args.iter().any(|a| a == "--lose-osd");
    config.lose_two = args.iter().any(|a| a == "--lose-two");
    config.lose_osd |= config.lose_two;
    Ok(config)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let config = match config(&args) {
        Ok(config) => config,
        Err(error) => {
            eprintln!("{error}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
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
