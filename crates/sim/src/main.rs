//! `cargo run -p basalt-sim -- --seed N [--steps S]`: replays one simulation run.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let Some(seed) = value("--seed") else {
        eprintln!("usage: basalt-sim --seed N [--steps S]");
        return ExitCode::FAILURE;
    };
    let mut config = basalt_sim::SimConfig::new(seed);
    if let Some(steps) = value("--steps") {
        config.steps = steps;
    }
    match basalt_sim::run(&config) {
        Ok(outcome) => {
            eprintln!("{outcome:?}");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            eprintln!("{failure}");
            ExitCode::FAILURE
        }
    }
}
