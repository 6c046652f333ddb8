//! Tidy checks of the source tree (STYLE.md §12), as an ordinary test: no `dbg!`, no
//! `println!` in libraries, no FIXME, `unsafe` only where allowed, and crate dependencies
//! that point down the layer list.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, files);
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
}

fn sources() -> Vec<(String, PathBuf, String)> {
    let crates = workspace().join("crates");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&crates).expect("crates").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let mut files = Vec::new();
        rust_files(&entry.path(), &mut files);
        for file in files {
            if file.ends_with("tests/tidy.rs") {
                continue; // this file names what it forbids
            }
            let text = std::fs::read_to_string(&file).expect("read source");
            out.push((name.clone(), file, text));
        }
    }
    out
}

/// Layers from the top; a crate may depend only on crates after it.
const LAYERS: &[&str] = &[
    "sim",
    "basalt",
    "bench",
    "target",
    "nbd",
    "nvmf",
    "vhost",
    "bdev",
    "client",
    "osd",
    "mon",
    "replication",
    "store",
    "wire",
    "io",
    "common",
];

#[test]
fn no_debug_leftovers_or_fixmes() {
    let forbidden = [concat!("db", "g!("), concat!("FIX", "ME")];
    for (_, file, text) in sources() {
        for word in forbidden {
            assert!(!text.contains(word), "{} contains {word}", file.display());
        }
    }
}

#[test]
fn libraries_do_not_print() {
    for (krate, file, text) in sources() {
        // Binaries (`basalt`, and tools such as `basalt-sim`'s main.rs) may print.
        let is_binary = krate == "basalt" || file.ends_with("src/main.rs");
        let is_library_source = !is_binary && file.components().any(|c| c.as_os_str() == "src");
        if !is_library_source {
            continue;
        }
        // Tests inside a library file may print; library code may not.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        for word in [concat!("print", "ln!("), concat!("print", "!(")] {
            assert!(
                !code.contains(word),
                "{} prints with {word}; libraries log with tracing",
                file.display()
            );
        }
    }
}

#[test]
fn unsafe_only_in_allowed_modules() {
    // STYLE.md §5: io, and vhost's guest memory handed to io_uring.
    let allowed = ["crates/io/src/", "crates/vhost/src/direct.rs"];
    for (_, file, text) in sources() {
        let path = file.to_string_lossy();
        let uses_unsafe =
            text.contains(concat!("unsafe", " {")) || text.contains(concat!("unsafe", " impl"));
        if uses_unsafe {
            assert!(
                allowed.iter().any(|a| path.contains(a)),
                "{path} uses unsafe outside the modules allowed"
            );
            assert!(
                text.contains("#![allow(unsafe_code)]"),
                "{path} must allow unsafe_code explicitly"
            );
        }
    }
}

#[test]
fn crate_dependencies_point_down() {
    let crates = workspace().join("crates");
    for (index, krate) in LAYERS.iter().enumerate() {
        let manifest =
            std::fs::read_to_string(crates.join(krate).join("Cargo.toml")).expect("manifest");
        for (other_index, other) in LAYERS.iter().enumerate() {
            let dependency = format!("basalt-{other}");
            let depends = manifest.lines().any(|line| {
                line.trim_start()
                    .starts_with(&format!("{dependency}.workspace"))
                    || line.trim_start().starts_with(&format!("{dependency} ="))
            });
            if depends {
                assert!(
                    other_index > index,
                    "{krate} depends on {other}, which is not below it"
                );
            }
        }
    }
    let listed: Vec<String> = std::fs::read_dir(&crates)
        .expect("crates")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    for krate in &listed {
        assert!(
            LAYERS.contains(&krate.as_str()),
            "crate {krate} is not in the tidy layer list"
        );
    }
}
