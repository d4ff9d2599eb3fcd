"""mpflow operators: the mathematics of online Bayesian updating.

A stream's posterior is a cloud of particles (:class:`mpflow.operators.state.ParticleState`). An *updater*
(``mpflow.operators.updaters``) moves it from p(x | o_1..m) to p(x | o_1..m+1) for a *model family*
(``mpflow.operators.models``). Exact references (Kalman filter, conjugate Gaussian posterior) live in
``mpflow.operators.references`` and are computed in float64; metrics compare particle clouds against them.

Example::

    import torch
    from mpflow.operators.models import make_model
    from mpflow.operators.models.priors import prior_from_spec
    from mpflow.operators.updaters import get_updater

    model = make_model("linear_gaussian", {}, state_dim=2)
    prior = prior_from_spec({"type": "gaussian", "mean": [0, 0], "cov": [[1, 0], [0, 1]]}, dim=2)
    updater = get_updater("gpf")
    state = updater.init(prior, model, num_particles=256, seed=0)
    state, info = updater.update(state, torch.tensor([[0.3, -1.2]]), model)
    print(state.particles.mean(1), info.log_evidence_increment)
"""
