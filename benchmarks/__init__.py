"""seqstate benchmarks: `make bench` prints ratios against peers measured in the same run."""
