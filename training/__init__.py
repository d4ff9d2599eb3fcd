"""Offline work: task distributions, meta-training of MPF operators, evaluation reports.
Imports ``mpflow.operators``; never imported by it or by ``mpflow.service``."""
