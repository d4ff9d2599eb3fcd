"""Offline work: task distributions, meta-training of MPF operators, evaluation reports, the CLI.
Imports ``operators``; never imported by it or by ``service``."""
