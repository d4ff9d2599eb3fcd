"""Samplers that give unlimited posterior draws: the Gaussian-flow resampler of a particle cloud (GPF eq. 16)
and the GPVI generator (Ratzlaff et al.), trainable for any log-density; GPVI samplers cached in the registry
load with :func:`load_sampler`."""

from mpflow.operators.samplers.cached import CachedSampler, load_sampler
from mpflow.operators.samplers.gpf_resampler import GaussianFlowResampler
from mpflow.operators.samplers.gpvi import GPVIGenerator

__all__ = ["CachedSampler", "GPVIGenerator", "GaussianFlowResampler", "load_sampler"]
