"""The benchmarks' own logic, on small inputs: what a script computes and prints, not what it measures."""
