# Turns the "RESULT WHO RW QD IOPS MEAN_US" lines a benchmark's guest printed into table
# rows comparing WHO = peer (its columns first) and WHO = basalt, in the order the cases
# ran: | 4k RW QDn | peer IOPS | peer mean µs | Basalt IOPS | Basalt mean µs | ratio |.
# A case measured in several rounds shows the medians (and the ratio of the median
# IOPS), then each round's ratio below the table.
# Usage: awk -v peer=kernel -f bench/guest-results.awk CONSOLE_LOG
/^RESULT / {
    key = $3 " QD" $4
    if (!(key in seen)) { order[++n] = key; seen[key] = 1 }
    c = ++count[$2, key]
    iops[$2, key, c] = $5; lat[$2, key, c] = $6
}
# The median of the c values a[who, key, 1..c].
function median(a, who, key, c,    i, j, t, v) {
    for (i = 1; i <= c; i++) v[i] = a[who, key, i] + 0
    for (i = 2; i <= c; i++) for (j = i; j > 1 && v[j - 1] > v[j]; j--) { t = v[j]; v[j] = v[j - 1]; v[j - 1] = t }
    return c % 2 ? v[(c + 1) / 2] : (v[c / 2] + v[c / 2 + 1]) / 2
}
END {
    rounds = 0
    for (i = 1; i <= n; i++) {
        k = order[i]
        cp = count[peer, k]; cb = count["basalt", k]
        if (cp > 1 || cb > 1) rounds = 1
        pi = median(iops, peer, k, cp); bi = median(iops, "basalt", k, cb)
        ratio = pi > 0 ? bi / pi : 0
        printf "| 4k %s | %d | %.1f | %d | %.1f | %.2f |\n", k, pi, median(lat, peer, k, cp), bi, median(lat, "basalt", k, cb), ratio
    }
    if (!rounds) exit
    printf "\nBasalt / %s IOPS in each round:\n\n", peer
    for (i = 1; i <= n; i++) {
        k = order[i]; line = ""
        for (r = 1; r <= count["basalt", k] && r <= count[peer, k]; r++)
            line = line (r > 1 ? ", " : "") sprintf("%.2f", iops[peer, k, r] > 0 ? iops["basalt", k, r] / iops[peer, k, r] : 0)
        printf "- 4k %s: %s\n", k, line
    }
}
