"""The MPF velocity network: shapes, permutation invariance of the DeepSet context, and the zero-initialised
residual (an untrained operator is exactly the Daum–Huang base flow)."""

import torch
from mpflow.operators.mpf.daum_huang import statistical_linearisation
from mpflow.operators.mpf.network import MPFVelocity


def make(d=3, B=2, N=64, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, d, generator=g) * 2 + 1
    score = -(x - 0.5) / 3.0
    return MPFVelocity(d), x, score, statistical_linearisation(x, score)


def test_untrained_velocity_is_the_base_flow():
    net, x, score, lik = make()
    ctx = net.context(x, lik)
    lam = torch.tensor([0.0, 0.7])
    v = net(x, lam, score, ctx)
    assert v.shape == x.shape
    # the whitened, diagonalised base flow is the Daum–Huang flow of the fitted Gaussian in x coordinates
    assert torch.allclose(v, net.base_flow(ctx).velocity(x.double(), lam).float(), atol=1e-4)


def test_trained_residual_changes_the_field_and_context_is_permutation_invariant():
    net, x, score, lik = make()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ctx = net.context(x, lik)
    perm = torch.randperm(x.shape[1])
    ctx_perm = net.context(x[:, perm], lik)
    assert torch.allclose(ctx.embedding, ctx_perm.embedding, atol=1e-5)
    lam = torch.tensor([0.3, 0.3])
    v = net(x, lam, score, ctx)
    assert not torch.allclose(v, net.base_flow(ctx).velocity(x.double(), lam).float(), atol=1e-3)
    # per particle: the field at a particle does not depend on the order of the others
    assert torch.allclose(net(x[:, perm], lam, score[:, perm], ctx_perm), v[:, perm], atol=1e-5)


def _layer_by_layer(net, z, lam, score_z, ctx):
    """h_θ and mean φ written as eq. 16–18 say, layer by layer with torch.tanh (the folded evaluation of
    MPFVelocity.residual_z / deepset must be this same function)."""
    h = torch.cat([z, torch.asinh(score_z)], -1)
    for j, layer in enumerate(net.layers):
        h = layer(h, layer.context_bias(ctx.embedding), lam)
        if j < len(net.layers) - 1:
            h = torch.tanh(h)
    emb = torch.tanh(net.phi[2](torch.tanh(net.phi[0](z)))).mean(1)
    return net.residual_bound * torch.tanh(h / net.residual_bound), emb


def test_folded_evaluation_is_the_layer_by_layer_network():
    net, x, score, lik = make(d=3, B=2, N=64)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ctx = net.context(x, lik)
    z = ctx.to_z(x)
    lam = torch.tensor([0.25, 0.8])
    score_z = score @ ctx.chol
    want_h, want_emb = _layer_by_layer(net, z, lam, score_z, ctx)
    assert want_h.abs().max() > 0.1  # a residual that is not trivially zero
    assert torch.allclose(net.residual_z(z, lam, score_z, ctx), want_h, atol=2e-5, rtol=1e-5)
    assert torch.allclose(net.deepset(z), want_emb, atol=2e-6)
    # and their gradients with respect to θ agree (training runs through the folded form)
    params = list(net.parameters())
    g_fold = torch.autograd.grad(net.residual_z(z, lam, score_z, ctx).square().sum(), params, retain_graph=True)
    g_ref = torch.autograd.grad(_layer_by_layer(net, z, lam, score_z, ctx)[0].square().sum(), params)
    for a, b in zip(g_fold, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_gradients_reach_every_parameter():
    net, x, score, lik = make()
    with torch.no_grad():
        net.layers[-1].linear.weight.normal_(0, 0.1)
    ctx = net.context(x, lik)
    net(x, torch.tensor([0.2, 0.9]), score, ctx).pow(2).mean().backward()
    missing = [n for n, p in net.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not missing, missing


def test_flow_step_integrates_the_forward_field():
    """flow_step integrates in the base flow's co-moving frame; the result must be the flow of the field
    f(x, λ) = forward(...) itself (integrated here in x coordinates with many RK4 steps), for a linear and a
    non-linear likelihood — particles and tracked log-density alike."""
    from mpflow.operators.models import make_model
    from mpflow.operators.mpf.daum_huang import linearised_likelihood
    from mpflow.operators.mpf.ode import integrate
    from mpflow.operators.mpf.step import flow_step

    torch.manual_seed(1)
    net = MPFVelocity(2, hidden=16, layers=2, embed=8)
    with torch.no_grad():
        for p in net.layers[-1].parameters():
            p.normal_(0, 0.3)
    for family, obs in (("linear_gaussian", torch.tensor([[2.0, -1.0]])), ("gmm", torch.tensor([[1.5]]))):
        model = make_model(family, {}, 2)
        x = torch.randn(1, 64, 2, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.5
        log_q = torch.zeros(1, 64)
        x1, lq1 = flow_step(net, model, obs, x, log_q, steps=40)
        ctx = net.context(x, linearised_likelihood(model, obs, x))

        def field(xt, lam, model=model, obs=obs, ctx=ctx):
            return net(xt, lam, model.score(obs, xt), ctx)

        x2, lq2 = integrate(field, x, log_q, 0.0, 1.0, steps=40)
        assert torch.allclose(x1, x2, atol=1e-4), family
        assert torch.allclose(lq1, lq2, atol=1e-3), family


def test_information_gate_is_one_minus_exp_of_the_kl_of_the_linearised_step():
    from mpflow.operators.mpf.network import information_gate

    g = torch.Generator().manual_seed(3)
    e = torch.rand(5, 3, generator=g, dtype=torch.float64) * 4
    eta = torch.randn(5, 3, generator=g, dtype=torch.float64) * 2
    post_cov = torch.diag_embed(1 / (1 + e))
    post_mean = eta / (1 + e)
    mvn = torch.distributions.MultivariateNormal
    prior = mvn(torch.zeros(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64))
    kl = torch.distributions.kl_divergence(mvn(post_mean, post_cov), prior)
    assert torch.allclose(information_gate(e, eta), 1 - torch.exp(-(kl**1.5)))
    assert torch.equal(information_gate(torch.zeros(2, 3), torch.zeros(2, 3)), torch.zeros(2))


def test_gated_residual_is_the_ungated_one_times_the_gate():
    net, x, score, lik = make()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    gated = MPFVelocity(3, residual_gate="information")
    gated.load_state_dict(net.state_dict())
    lam = torch.tensor([0.2, 0.6])
    ctx, ctx_g = net.context(x, lik), gated.context(x, lik)
    gate = ctx_g.network.gate[:, 0, 0]
    assert bool(((gate > 0.05) & (gate < 1)).all())
    z, s_z = ctx.to_z(x), score @ ctx.chol
    h, h_g = net.residual_z(z, lam, s_z, ctx), gated.residual_z(z, lam, s_z, ctx_g)
    assert torch.allclose(h_g, gate[:, None, None] * h, atol=1e-6)
    feats = net.features(z, s_z)  # the co-moving frame's head (flow_step) is gated alike
    got = gated.residual(feats, lam, ctx_g, eigenbasis=True)
    assert torch.allclose(got, gate[:, None, None] * (h @ ctx.eigvec), atol=1e-5)
    # a step that carries no information (Λ = 0, η = 0) leaves the trained field at the base flow, which is 0
    from mpflow.operators.mpf.daum_huang import GaussianLikelihood

    flat = GaussianLikelihood(torch.zeros(2, 3, 3), torch.zeros(2, 3))
    assert torch.equal(gated(x, lam, torch.zeros_like(x), gated.context(x, flat)), torch.zeros_like(x))
    assert net(x, lam, torch.zeros_like(x), net.context(x, flat)).abs().max() > 1e-2


def test_unknown_residual_gate_is_refused():
    import pytest

    with pytest.raises(ValueError, match="residual_gate"):
        MPFVelocity(2, residual_gate="kl")


def test_gate_stops_a_biased_residual_from_drifting():
    """The same perturbed θ (a residual that is wrong by a fixed relative amount every step) over 100 steps of
    a static linear-Gaussian model: ungated, the mean error in posterior sd grows about linearly with the step;
    gated by the step's information it levels off (module docstring of operators.mpf.network)."""
    from mpflow.operators.models import make_model
    from mpflow.operators.mpf.step import flow_step
    from mpflow.operators.references import kalman_filter

    torch.manual_seed(0)
    model = make_model("linear_gaussian", {}, 2)
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(1, 2, generator=g)
    obs = truth[:, None] + 3**0.5 * torch.randn(1, 100, 2, generator=g)
    means, covs, _ = kalman_filter(torch.zeros(1, 2), torch.eye(2)[None], model, obs.double())
    errors = {}
    for gate in ("none", "information"):
        net = MPFVelocity(2, hidden=16, embed=8, residual_gate=gate)
        with torch.no_grad():
            net.layers[-1].ctx.bias.fill_(0.05)  # a constant residual: a bias in every step
        x = torch.randn(1, 256, 2, generator=torch.Generator().manual_seed(2))
        x = (x - x.mean(1, keepdim=True)) @ torch.linalg.inv(torch.linalg.cholesky(torch.cov(x[0].T, correction=0))).T
        err = []
        with torch.no_grad():
            for t in range(100):
                x, _ = flow_step(net, model, obs[:, t], x, None, divergence="none")
                sd = covs[0, t].diagonal().sqrt()
                err.append(float(((x[0].double().mean(0) - means[0, t]) / sd).norm() / 2**0.5))
        errors[gate] = err
    ungated, gated = errors["none"], errors["information"]
    # measured: ungated 0.20, 0.88, 1.72 sd at steps 10, 50, 100; gated 0.019, 0.038, 0.044
    assert ungated[99] > 5 * ungated[9] and ungated[99] > 1.8 * ungated[49]  # the drift the gate is for
    assert gated[99] < 1.3 * gated[49] and gated[99] < ungated[99] / 20


def test_serving_step_reuses_the_start_score_and_equals_the_tracked_step():
    """Without density tracking the first RK4 stage takes the features of the start point from the score the
    linearisation computed (one score evaluation fewer); the particles are those of the tracked step, which
    recomputes every stage."""
    from mpflow.operators.models import make_model
    from mpflow.operators.mpf.step import flow_step

    torch.manual_seed(2)
    net = MPFVelocity(2, hidden=16, layers=2, embed=8)
    with torch.no_grad():
        for p in net.layers[-1].parameters():
            p.normal_(0, 0.3)
    for family, obs in (("gmm", torch.tensor([[1.5]])), ("stochastic_volatility", torch.tensor([[0.4, -2.0]]))):
        model = make_model(family, {}, 2)
        calls = []
        score = model.score
        model.score = lambda o, x, score=score, calls=calls: calls.append(1) or score(o, x)
        x = torch.randn(1, 128, 2, generator=torch.Generator().manual_seed(0)) * 1.5 + 0.5
        with torch.no_grad():
            served, _ = flow_step(net, model, obs, x, None, divergence="none")
        assert len(calls) == 4, family  # the fit's + stages 2–4 (one RK4 step: 4 stages)
        tracked, _ = flow_step(net, model, obs, x, torch.zeros(1, 128), divergence="exact")
        assert len(calls) == 4 + 5, family
        assert torch.allclose(served, tracked, atol=1e-5), family
        assert not torch.allclose(served, flow_step(MPFVelocity(2), model, obs, x, None, divergence="none")[0])


def test_unknown_linearisation_is_refused():
    import pytest

    with pytest.raises(ValueError, match="linearisation"):
        MPFVelocity(2, linearisation="laplace")


def test_importance_linearised_step_may_widen_and_is_exact_untrained():
    """With ``linearisation="importance"`` the untrained operator moves the cloud exactly onto the moments of
    the reweighted cloud, also where that is wider than the cloud (eigenvalues of Λ_z below 0, which Stein's
    fit would clip at 0): here a likelihood exp(0.3 x₁²) that favours both tails."""
    from mpflow.operators import gaussian
    from mpflow.operators.models import make_model
    from mpflow.operators.mpf.step import flow_step

    model = make_model("gmm", {}, 2)
    model.log_likelihood = lambda obs, x: 0.3 * x[..., 0] ** 2
    x = torch.randn(1, 400, 2, generator=torch.Generator().manual_seed(1)) * torch.tensor([0.5, 1.0]) + 0.2
    target_mean, target_cov = gaussian.moments(x.double(), model.log_likelihood(None, x).double())
    net = MPFVelocity(2, linearisation="importance")
    with torch.no_grad():
        x1, _ = flow_step(net, model, torch.zeros(1, 1), x, None, divergence="none")
    m1, c1 = gaussian.moments(x1.double())
    assert float(c1[0, 0, 0]) > 1.1 * float(gaussian.moments(x.double())[1][0, 0, 0])  # widened
    torch.testing.assert_close(m1, target_mean, rtol=0, atol=1e-4)
    torch.testing.assert_close(c1, target_cov, rtol=0, atol=1e-4)


def test_importance_linearised_step_stays_finite_on_an_outlying_observation():
    """o = 50 for a cloud around 0: the likelihood weights one particle; the step's fit hands over to Stein's,
    so the particles move towards the observation instead of collapsing or going non-finite."""
    from mpflow.operators.models import make_model
    from mpflow.operators.mpf.step import flow_step

    model = make_model("gmm", {}, 2)
    x = torch.randn(1, 256, 2, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x1, _ = flow_step(MPFVelocity(2, linearisation="importance"), model, torch.tensor([[50.0]]), x, None)
    assert bool(torch.isfinite(x1).all())
    assert float(x1.std(1).min()) > 0.1 and float(x1.mean(1).sum()) > 5.0
