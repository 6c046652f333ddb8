//! The Linux kernel's NBD client (`nbd-client` and nbd.ko), with fio, blkdiscard and
//! ext4, against a 3-replica Basalt image that `basalt target` exports over NBD: a small
//! Linux guest under QEMU (scripts/guest) runs `tests/guest/nbd_kernel.sh` against the
//! target on the host's loopback.

mod support;

use support::{ClusterProcesses, ScratchDir};

#[test]
fn the_linux_nbd_client_uses_an_image() {
    const SIZE: u64 = 128 << 20;
    let dir = ScratchDir::new("nbd-guest");
    let cluster = ClusterProcesses::start_with_image(&dir.path, SIZE, None);
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
