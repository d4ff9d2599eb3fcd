"""Speed and accuracy harnesses: ``python -m benchmarks.<name>`` prints a table and writes JSON + PNG."""
