# Helpers the benchmark scripts source.

# The median of numbers, one per line.
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

# The median step (ms) of a run's second half, from its --metrics lines
# (training steps only: an eval's line has no "loss" key).
steady_ms() {
  sed -n 's/.*"elapsed_s":\([0-9.e+-]*\).*"loss".*/\1/p' "$1" |
    awk '{ t[NR] = $1 } END { for (i = int(NR / 2) + 1; i <= NR; ++i) print 1000 * (t[i] - t[i - 1]) }' |
    median
}
