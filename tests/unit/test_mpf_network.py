"""The MPF velocity network: shapes, permutation invariance of the DeepSet context, and the zero-initialised
residual (an untrained operator is exactly the Daum–Huang base flow)."""

import torch

from operators.mpf.gaussian_flow import statistical_linearisation
from operators.mpf.network import MPFVelocity


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
    from operators.models import make_model
    from operators.mpf.gaussian_flow import linearised_likelihood
    from operators.mpf.ode import integrate
    from operators.mpf.step import flow_step

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
