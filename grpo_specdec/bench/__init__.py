"""What the benchmarks measure with, and the training job's end-of-run comparison too: the
side-by-side protocol and its statistics (`measure`), the tail workload (`tail_shape`), and
the comparison of speculation configurations on a job's next batch (`compare`)."""
