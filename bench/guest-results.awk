# Turns the "RESULT WHO RW QD IOPS MEAN_US" lines a benchmark's guest printed into table
# rows comparing WHO = peer (its columns first) and WHO = basalt, in the order the cases
# ran: | 4k RW QDn | peer IOPS | peer mean µs | Basalt IOPS | Basalt mean µs | ratio |.
# Usage: awk -v peer=kernel -f bench/guest-results.awk CONSOLE_LOG
/^RESULT / {
    key = $3 " QD" $4
    if (!(key in seen)) { order[++n] = key; seen[key] = 1 }
    iops[$2, key] = $5; lat[$2, key] = $6
}
END {
    for (i = 1; i <= n; i++) {
        k = order[i]
        ratio = iops[peer, k] > 0 ? iops["basalt", k] / iops[peer, k] : 0
        printf "| 4k %s | %d | %.1f | %d | %.1f | %.2f |\n", k, iops[peer, k], lat[peer, k], iops["basalt", k], lat["basalt", k], ratio
    }
}
