"""Samplers that give unlimited posterior draws: the Gaussian-flow resampler of a particle cloud (GPF eq. 16)
and the GPVI generator (Ratzlaff et al.), trainable for any log-density."""

from operators.samplers.gaussian_flow import GaussianFlowResampler
from operators.samplers.gpvi import GPVIGenerator

__all__ = ["GPVIGenerator", "GaussianFlowResampler"]
