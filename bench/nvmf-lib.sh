# Sourced by the NVMe/TCP benchmarks (nvmf-path.sh, image-nvmf.sh). The caller sets BASALT.

# nvmf_export SOCK BDEV NQN: on the `basalt target` whose RPC socket is SOCK, a TCP
# transport and subsystem NQN (any host) with BDEV as its namespace, listening on
# 127.0.0.1 at the first port of 14420-14520 that binds; sets URI.
nvmf_export() {
    local sock=$1 bdev=$2 nqn=$3 port
    local rpc=("$BASALT" rpc -s "$sock")
    # (Each step returns on failure itself: callers write `nvmf_export ... || die`, which
    # turns errexit off inside.)
    "${rpc[@]}" nvmf_create_transport '{"trtype":"TCP"}' >/dev/null || return 1
    "${rpc[@]}" nvmf_create_subsystem "{\"nqn\":\"$nqn\",\"allow_any_host\":true}" >/dev/null || return 1
    "${rpc[@]}" nvmf_subsystem_add_ns "{\"nqn\":\"$nqn\",\"namespace\":{\"bdev_name\":\"$bdev\"}}" >/dev/null || return 1
    for port in $(seq 14420 14520); do
        if "${rpc[@]}" nvmf_subsystem_add_listener "{\"nqn\":\"$nqn\",\"listen_address\":{\"trtype\":\"TCP\",\"adrfam\":\"IPv4\",\"traddr\":\"127.0.0.1\",\"trsvcid\":\"$port\"}}" >/dev/null 2>&1; then
            URI="nvme+tcp://127.0.0.1:$port/$nqn"
            return 0
        fi
    done
    echo "no free port in 14420-14520 for $nqn" >&2
    return 1
}
