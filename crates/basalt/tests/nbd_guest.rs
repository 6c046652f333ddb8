//! The Linux kernel's NBD client (`nbd-client` and nbd.ko), with fio, blkdiscard and
//! ext4, against a 3-replica Basalt image that `basalt target` exports over NBD: a small
//! Linux guest under QEMU (scripts/guest) runs `tests/guest/nbd_kernel.sh` against the
//! target on the host's loopback.

mod support;

use std::time::Duration;

use support::{ClusterProcesses, ScratchDir};

#[test]
fn the_linux_nbd_client_uses_an_image() {
    const SIZE: u64 = 128 << 20;
    let dir = ScratchDir::new("nbd-guest");
    let cluster = ClusterProcesses::start(&dir.path, 3);
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", &SIZE.to_string()]);
    cluster.wait_clean(Duration::from_secs(60));
    let (target, uri) = support::export_image(&dir.path, &cluster, "rbd", "vol");
    let port = uri
        .trim_start_matches("nbd://127.0.0.1:")
        .split('/')
        .next()
        .expect("port")
        .to_string();

    support::run_guest(
        "nbd_kernel.sh",
        &[&port, "img", &SIZE.to_string()],
        "nbd_kernel: done",
        || target.log_text(),
    );
    target.stop();
}
