"""Small helpers shared by the trainer, the evaluators and the benchmarks."""
