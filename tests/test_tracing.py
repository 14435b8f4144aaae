import math
import random
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer.reparam import ProjectedNormalReparam

from pyro_hmc_plus import HMC, NUTS, EngineFallbackWarning, SamplingWarning, GradientEngine, UntraceableModel, from_model, from_potential_fn
import pyro_hmc_plus
from pyro_hmc_plus import _compile, tracing
from pyro_hmc_plus.models import ar1_loop, sequential_plate_regression

from helpers import assert_mean, assert_variance
from models import PRECISION, EIGHT_SCHOOLS_SIGMA, EIGHT_SCHOOLS_Y, dirichlet_categorical, eight_schools, gauss2d


def _latent_branch(p):
    x = p["x"]
    if x.sum() > 0:  # Python control flow on a latent: one trace cannot represent it
        return (x**2).sum()
    return (2 * x**2).sum()


def _latent_item(p):
    return (p["x"] ** 2).sum() * (1 + 0 * p["x"].sum().item())


def _latent_tolist(p):
    scale = p["x"].detach().tolist()[0]
    return (p["x"] ** 2).sum() + 0 * scale


def _latent_index(p):  # torch's C++ reads the 0-dim index with item(), below any Python hook
    return p["x"][p["x"].argmax()] ** 2


def _latent_arange(p):
    return (p["x"] ** 2).sum() * torch.arange((p["x"] > 0).sum() + 1).sum()


def _latent_mask(p):  # as many elements as are positive at this point
    return (p["x"][p["x"] > 0] ** 2).sum()


def _latent_unique_count(p):
    return (p["x"] ** 2).sum() * torch.unique(p["x"] > 0).numel()


@pytest.mark.parametrize("fn", [_latent_branch, _latent_item, _latent_tolist, _latent_index, _latent_arange,
                                _latent_mask, _latent_unique_count])
def test_latent_escapes_are_refused(fn):
    flat = from_potential_fn(fn, {"x": torch.tensor([0.5, -0.2])})
    with pytest.raises(UntraceableModel):
        tracing.trace(flat.value_and_grad, (flat.initial_z,))


def _assert_traced_with_eagers_values(flat):
    """The default engine traces ``flat`` (three latent dimensions) without falling back, and
    its value and gradient at another point are the eager potential's."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    assert engine.name == "trace"
    z = torch.tensor([-1.0, 2.0, 0.3])
    for actual, expected in zip(engine.value_and_grad(z), flat.value_and_grad(z)):
        assert torch.allclose(actual, expected)


def test_selections_whose_shapes_the_data_fix_are_traced():
    """Masks and indices that are data, and integer indices computed from the latent
    variables (their shape is their own), keep the traced engine and its values."""
    mask = torch.tensor([True, False, True])

    def fn(p):
        x = p["x"]
        return (x[mask] ** 2).sum() + x[x.argsort()].cumsum(0).pow(2).sum() + x.masked_select(mask).sum()

    _assert_traced_with_eagers_values(from_potential_fn(fn, {"x": torch.tensor([0.5, -0.2, 1.0])}))


def test_writes_through_masks_computed_from_the_latents_are_traced():
    """``x[mask] = c`` with a mask of ``x``'s shape computed from the latent variables is a
    ``where``: torch reads a 0-dim mask with ``item()`` and counts a larger one's elements
    (both refused, so the model fell back to eager autograd). Pyro's ``safe_normalize``
    writes so under ``ProjectedNormalReparam``. The masks are true at one point and false at
    the other for some elements: eager's values at both."""

    def fn(p):
        y = p["x"] * 1.0
        y[y.abs() > 0.8] = 0.0
        w = p["x"][2] * 1.0
        w[w < 0.5] = 2.0  # a 0-dim mask
        return (y**2).sum() + w * p["x"].sum()

    _assert_traced_with_eagers_values(from_potential_fn(fn, {"x": torch.tensor([0.5, -0.2, 1.0])}))

    def directional():
        loc = pyro.sample("loc", dist.ProjectedNormal(torch.zeros(3)))
        pyro.sample("angle", dist.VonMises(torch.atan2(loc[1], loc[0]), 2.0), obs=torch.tensor(0.5))

    reparam = pyro.poutine.reparam(directional, config={"loc": ProjectedNormalReparam()})
    _assert_traced_with_eagers_values(from_model(reparam))


def test_loops_over_a_latent_tensors_length_are_traced():
    """``len()`` of a value computed from the latent variables is its shape, which no value
    decides (the recorder refuses the ops whose results' shapes values decide): the trace
    keeps it, as it keeps ``.shape`` (``len()`` sent such models to eager autograd)."""

    def model():
        theta = pyro.sample("theta", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        for i in range(len(theta)):
            pyro.sample(f"y_{i}", dist.Normal(theta[i], 1.0), obs=torch.tensor(float(i)))
        pyro.factor("rows", sum(-0.5 * t**2 for t in theta * 0.1))

    _assert_traced_with_eagers_values(from_model(model))


def test_untraceable_potential_falls_back_to_eager_with_one_warning():
    flat = from_potential_fn(_latent_branch, {"x": torch.tensor([0.5, -0.2])})
    with pytest.warns(EngineFallbackWarning, match="Python `if`"):
        engine = GradientEngine(flat)
    assert engine.name == "eager"
    U, g = engine.value_and_grad(torch.tensor([-1.0, 0.5]))
    assert torch.allclose(U, torch.tensor(2.5)) and torch.allclose(g, torch.tensor([-4.0, 2.0]))


def test_untraceable_model_warns_why_without_pyros_trace_shapes():
    """Pyro re-raises an error from inside a model with a table of its sites' shapes
    appended; the fallback warning says why in one sentence, not with that table."""

    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        if mu > 0:  # a Python branch on a latent value
            pyro.sample("y", dist.Normal(mu, 1.0), obs=torch.tensor(1.0))

    with pytest.warns(EngineFallbackWarning) as record:
        GradientEngine(from_model(model))
    message = str(record[0].message)
    assert "Python `if`" in message and "Trace Shapes" not in message


def test_data_only_branch_is_traced():
    data = torch.tensor([1.0, 2.0])

    def pot(p):
        if data.sum() > 0:  # depends on data only: safe to trace
            return ((p["x"] - data) ** 2).sum()
        return (p["x"] ** 2).sum()

    flat = from_potential_fn(pot, {"x": torch.zeros(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    assert engine.name == "trace"
    U, g = engine.value_and_grad(torch.tensor([0.0, 0.0]))
    assert torch.allclose(U, torch.tensor(5.0)) and torch.allclose(g, torch.tensor([-2.0, -4.0]))


def _model_with_params(y):
    loc = pyro.param("loc", torch.tensor(2.0))
    scale = pyro.param("scale", torch.tensor(0.5), constraint=dist.constraints.positive)
    x = pyro.sample("x", dist.Normal(loc, 1.0))
    pyro.sample("y", dist.Normal(x, scale), obs=y)


@pytest.mark.parametrize("num_chains", [1, 2])
def test_pyro_params_are_constants_of_the_traced_potential(num_chains):
    """``pyro.param`` values (tensors that require grad) are constants of the potential, as in
    Pyro's MCMC; they used to reach the recorded program as constants requiring grad, which
    TorchScript refuses. Traced, without falling back: x | y=0 ~ N(2 / 5, 1 / 5)."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    kernel = NUTS(_model_with_params)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        mcmc = pyro_hmc_plus.MCMC(kernel, num_samples=1000, warmup_steps=300, num_chains=num_chains,
                                  disable_progbar=True, warn_on_problems=False)
        mcmc.run(torch.tensor(0.0))
    assert kernel._engine.name == "trace"
    x = mcmc.get_samples(group_by_chain=True)["x"]
    for chain in x:
        assert_mean(chain, 0.4)
        assert_variance(chain, 0.2)
    pyro.clear_param_store()


class _Regression(pyro.nn.PyroModule):
    """y ~ N(w x, 1) with w ~ N(0, 10^2) as a PyroSample prior: expanded while Pyro's
    validation is on (its default), so the prior validates its samples whatever the
    context says later (``expand`` copies the flag into the instance)."""

    def __init__(self):
        super().__init__()
        self.w = pyro.nn.PyroSample(dist.Normal(0.0, 10.0).expand([1]).to_event(1))  # as Pyro's examples write priors

    def forward(self, x, y):
        w = self.w  # sampled here, outside the plate
        with pyro.plate("data", len(x)):
            pyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


def test_distribution_validation_of_latent_values_does_not_stop_tracing():
    """A distribution that validates its arguments or samples (``if not
    torch._is_all_true(valid)``) on values computed from the latent variables, as every
    PyroModule's PyroSample prior does, used to count as a Python branch on a latent value:
    a fallback to eager autograd. It is checked at the trace point instead. Exact posterior:
    w | x, y ~ N(sum(x y) / (sum(x^2) + 0.01), 1 / (sum(x^2) + 0.01))."""
    with pyro.validation_enabled(True):
        model = _Regression()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, generator=gen)
    y = 0.7 * x + torch.randn(20, generator=gen)
    precision = (x * x).sum() + 0.01
    pyro.set_rng_seed(0)
    kernel = NUTS(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        mcmc = MCMC(kernel, num_samples=1000, warmup_steps=300, disable_progbar=True)
        mcmc.run(x, y)
    assert kernel.engine_name == "trace"
    w = mcmc.get_samples()["w"].numpy()
    assert_mean(w, ((x * y).sum() / precision).item())
    assert_variance(w, (1 / precision).item())


def test_constant_cholesky_is_folded_away():
    engine = GradientEngine(from_model(gauss2d))
    targets = {str(n.target) for n in engine._graph.graph.nodes}
    assert not any("cholesky" in t for t in targets)


def test_matrices_of_products_are_laid_out_along_their_longer_dimension():
    """A regression's gradient multiplies by the design matrix ``X`` (tall) and by its
    transpose (wide, which autograd writes as a view of ``X``): each constant is laid out
    along its longer dimension, ``X`` column by column and its transpose row by row (a
    5,000 x 25 product 21 -> 6 µs and 12 -> 9 µs in float32), with the same gradient; the two
    share one copy of the data. A wide matrix given column by column is laid out row by row."""

    def regression(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    def matrices(engine):
        graph = engine._graph
        return [getattr(graph, n.args[0].target) for n in graph.graph.nodes
                if n.target is torch.ops.aten.mv.default and n.args[0].op == "get_attr"]

    def wide(x):  # 3 observations of 40 predictors, given column by column
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(x @ w, 1.0).to_event(1), obs=torch.ones(3))

    x = torch.randn(500, 5)
    for model, args, shapes in ((regression, (x, torch.bernoulli(torch.sigmoid(x @ torch.ones(5)))), [(5, 500), (500, 5)]),
                                (wide, (torch.randn(40, 3).t(),), [(3, 40), (40, 3)])):
        flat = from_model(model, args)
        engine = GradientEngine(flat)
        assert sorted(tuple(m.shape) for m in matrices(engine)) == shapes
        for m in matrices(engine):
            assert (m.t() if m.shape[0] > m.shape[1] else m).is_contiguous()
        tall, wide = sorted(matrices(engine), key=lambda m: -m.shape[0])
        assert tall.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr()  # one copy: X^T's
        z = torch.randn_like(flat.initial_z)
        for a, b in zip(engine.value_and_grad(z), flat.value_and_grad(z)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)


def test_a_batch_of_points_multiplies_the_design_matrix_in_batch_order():
    """``vmap`` of a regression's ``X @ w`` over a batch of points (the vectorized chains'
    gradient) is ``t(X @ t(W))``, or ``t(exp(X @ t(W)))`` where an elementwise op reads the
    product first: written ``W @ t(X)``, the product comes out in the order the batch is
    read, and no transpose is left in the batched gradient (4 chains of the logistic
    regression benchmark: 310 -> 148 µs a call), with the same values."""

    def logistic(x, y):
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
        b = pyro.sample("b", dist.Normal(0.0, 1.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)

    def poisson(x, y):  # exp reads the product before vmap's transpose
        w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Poisson((x @ w).exp()), obs=y)

    x = torch.randn(500, 5)
    for model, y, dim in ((logistic, torch.bernoulli(torch.sigmoid(x @ torch.ones(5))), 6),
                          (poisson, torch.poisson(torch.exp(x @ torch.full((5,), 0.3))), 5)):
        flat = from_model(model, (x, y))
        engine = GradientEngine(flat)
        graph = engine._batched_graph(4)
        targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.aten.mm.default) == 2
        assert not {torch.ops.aten.permute.default, torch.ops.aten.t.default, torch.ops.aten.transpose.int} & set(targets)
        z = 0.3 * torch.randn(4, dim)
        for a, b in zip(engine.value_and_grad(z), flat.batched_value_and_grad(z)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)

    def fn(w, x):  # transposed products read by elementwise ops, and one transposed back
        return (x @ w.t()).t().exp(), (x @ w.t()).sigmoid().t() * 2, (x @ w.t()).t().t() * 2

    w, x = torch.randn(5, 6), torch.randn(10, 6)
    gm = tracing.trace(fn, (w, x), check_escapes=False)
    for ours, eager in zip(gm(w, x), fn(w, x)):
        assert ours.shape == eager.shape and torch.allclose(ours, eager, rtol=1e-6)
    for op in (torch.ops.aten.exp.default, torch.ops.aten.sigmoid.default):
        (node,) = [n for n in gm.graph.nodes if n.target is op]
        assert node.args[0].target is torch.ops.aten.mm.default  # computed transposed, not transposed after


def test_folding_keeps_layouts_where_the_graph_reads_them():
    """``as_strided`` reads its input's memory layout, which an elementwise op takes from its
    operands: with one in the graph, a folded transposed constant keeps its strides, and the
    graph its values."""
    aten = torch.ops.aten
    root = torch.nn.Module()
    root.register_buffer("x", torch.arange(6.0).reshape(2, 3))
    graph = torch.fx.Graph()
    z = graph.placeholder("z")
    transposed = graph.call_function(aten.t.default, (graph.get_attr("x"),))
    total = graph.call_function(aten.add.Tensor, (transposed, z))
    graph.output(graph.call_function(aten.as_strided.default, (total, [3, 2], [1, 3])))
    gm = torch.fx.GraphModule(root, graph)
    z = torch.randn(3, 2)
    expected = gm(z)
    tracing.fold_constants(gm)
    assert aten.t.default not in [n.target for n in gm.graph.nodes]  # folded
    assert torch.equal(gm(z), expected)

def _prior_of(d):
    """A model whose only latent site has prior ``d`` (and one observation of its sum)."""

    def model():
        x = pyro.sample("x", d)
        pyro.sample("y", dist.Normal(x.sum(), 1.0), obs=torch.tensor(0.3))

    return model, ()


def _likelihood_of(make, latents, true, n=20):
    """A model whose ``n`` observations follow ``make(**params)`` in a plate, ``params``
    sampled from ``latents`` (name -> prior); the data drawn at ``true``."""
    with torch.random.fork_rng():  # leaves the other tests' random numbers alone
        torch.manual_seed(1)
        y = make(**true).sample((n,))

    def model(y):
        params = {name: pyro.sample(name, prior) for name, prior in latents.items()}
        with pyro.plate("n", len(y)):
            pyro.sample("y", make(**params), obs=y)

    return model, (y,)


_REAL, _POSITIVE, _UNIT = dist.Normal(0.0, 1.0), dist.LogNormal(0.0, 0.5), dist.Beta(2.0, 2.0)
_SIMPLEX = dist.Dirichlet(torch.ones(3))
_TRIL = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0], [0.2, 0.3, 1.0]])
_ORDERED = dist.TransformedDistribution(dist.Normal(0.0, 2.0).expand([3]).to_event(1),
                                        [dist.transforms.OrderedTransform()])
_ZOO = {
    "classic question": (gauss2d, ()),
    "eight schools": (eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)),
    "dirichlet categorical": (dirichlet_categorical, (torch.tensor([3.0, 5.0, 2.0]),)),
    **{f"prior {name}": _prior_of(d) for name, d in {
        "HalfCauchy": dist.HalfCauchy(1.0), "InverseGamma": dist.InverseGamma(3.0, 2.0),
        "Gamma": dist.Gamma(2.0, 1.0), "Exponential": dist.Exponential(2.0), "Uniform": dist.Uniform(-1.0, 3.0),
        "Beta": dist.Beta(2.0, 3.0), "Dirichlet": dist.Dirichlet(torch.ones(4)),
        "LKJCholesky": dist.LKJCholesky(3, 2.0), "LKJ": dist.LKJ(3, 2.0), "Laplace": dist.Laplace(0.0, 1.0),
        "StudentT": dist.StudentT(3.0, 0.0, 1.0), "Cauchy": dist.Cauchy(0.0, 1.0), "Gumbel": dist.Gumbel(0.0, 1.0),
        "Weibull": dist.Weibull(1.0, 1.5), "Pareto": dist.Pareto(1.0, 3.0), "Chi2": dist.Chi2(3.0),
        "VonMises": dist.VonMises(0.0, 2.0), "MultivariateNormal": dist.MultivariateNormal(torch.zeros(3), scale_tril=_TRIL),
        "LowRankMultivariateNormal": dist.LowRankMultivariateNormal(torch.zeros(3), torch.ones(3, 1), torch.ones(3)),
        "Kumaraswamy": dist.Kumaraswamy(2.0, 3.0), "SoftLaplace": dist.SoftLaplace(0.0, 1.0),
        "AsymmetricLaplace": dist.AsymmetricLaplace(0.0, 1.0, 2.0), "Logistic": dist.Logistic(0.0, 1.0),
        "FoldedDistribution": dist.FoldedDistribution(dist.Normal(1.0, 1.0)),
        "TransformedDistribution": dist.TransformedDistribution(dist.Normal(0.0, 1.0), [dist.transforms.ExpTransform()]),
        "expand to_event": dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2),
    }.items()},
    **{f"likelihood {name}": _likelihood_of(*case) for name, case in {
        "Normal": (dist.Normal, {"loc": _REAL, "scale": _POSITIVE}, {"loc": torch.tensor(1.0), "scale": torch.tensor(2.0)}),
        "StudentT": (lambda df, loc: dist.StudentT(df, loc, 1.0), {"df": dist.Gamma(2.0, 0.1), "loc": _REAL},
                     {"df": torch.tensor(4.0), "loc": torch.tensor(0.5)}),
        "Poisson": (dist.Poisson, {"rate": _POSITIVE}, {"rate": torch.tensor(3.0)}),
        "Binomial": (lambda p: dist.Binomial(10, p), {"p": _UNIT}, {"p": torch.tensor(0.3)}),
        "NegativeBinomial": (lambda c, logits: dist.NegativeBinomial(c, logits=logits), {"c": _POSITIVE, "logits": _REAL},
                             {"c": torch.tensor(3.0), "logits": torch.tensor(0.2)}),
        "Bernoulli logits": (lambda logits: dist.Bernoulli(logits=logits), {"logits": _REAL}, {"logits": torch.tensor(0.3)}),
        "Bernoulli probs": (dist.Bernoulli, {"probs": _UNIT}, {"probs": torch.tensor(0.3)}),
        "Categorical logits": (lambda logits: dist.Categorical(logits=logits), {"logits": _REAL.expand([3]).to_event(1)},
                               {"logits": torch.tensor([0.1, 0.5, -0.3])}),
        "Multinomial": (lambda probs: dist.Multinomial(7, probs), {"probs": _SIMPLEX}, {"probs": torch.tensor([0.2, 0.5, 0.3])}),
        "Beta": (lambda a, b: dist.Beta(a, b), {"a": _POSITIVE, "b": _POSITIVE}, {"a": torch.tensor(2.0), "b": torch.tensor(3.0)}),
        "Gamma": (lambda a, b: dist.Gamma(a, b), {"a": _POSITIVE, "b": _POSITIVE}, {"a": torch.tensor(2.0), "b": torch.tensor(3.0)}),
        "Weibull": (lambda s, k: dist.Weibull(s, k), {"s": _POSITIVE, "k": _POSITIVE}, {"s": torch.tensor(2.0), "k": torch.tensor(1.5)}),
        "GammaPoisson": (lambda a, b: dist.GammaPoisson(a, b), {"a": _POSITIVE, "b": _POSITIVE}, {"a": torch.tensor(2.0), "b": torch.tensor(0.5)}),
        "ZeroInflatedNegativeBinomial": (
            lambda c, logits, gate: dist.ZeroInflatedNegativeBinomial(c, logits=logits, gate=gate),
            {"c": _POSITIVE, "logits": _REAL, "gate": _UNIT},
            {"c": torch.tensor(3.0), "logits": torch.tensor(0.2), "gate": torch.tensor(0.3)}),
        "BetaBinomial": (lambda a, b: dist.BetaBinomial(a, b, 10), {"a": _POSITIVE, "b": _POSITIVE},
                         {"a": torch.tensor(2.0), "b": torch.tensor(3.0)}),
        "DirichletMultinomial": (lambda c: dist.DirichletMultinomial(c, 7), {"c": _POSITIVE.expand([3]).to_event(1)},
                                 {"c": torch.tensor([1.0, 2.0, 3.0])}),
        "OrderedLogistic": (lambda p, c: dist.OrderedLogistic(p, c), {"p": _REAL, "c": _ORDERED},
                            {"p": torch.tensor(0.3), "c": torch.tensor([-1.0, 0.0, 1.5])}),
        "MixtureSameFamily": (lambda w, loc: dist.MixtureSameFamily(dist.Categorical(w), dist.Normal(loc, 1.0)),
                              {"w": _SIMPLEX, "loc": _REAL.expand([3]).to_event(1)},
                              {"w": torch.tensor([0.2, 0.3, 0.5]), "loc": torch.tensor([-2.0, 0.0, 2.0])}),
        "MixtureSameFamily logits": (  # unlike the simplex, free logits see log_softmax's whole gradient
            lambda logits, loc: dist.MixtureSameFamily(dist.Categorical(logits=logits), dist.Normal(loc, 1.0)),
            {"logits": _REAL.expand([3]).to_event(1), "loc": _REAL.expand([3]).to_event(1)},
            {"logits": torch.tensor([0.0, 1.0, -1.0]), "loc": torch.tensor([-2.0, 0.0, 2.0])}),
        "Geometric": (lambda p: dist.Geometric(p), {"p": _UNIT}, {"p": torch.tensor(0.3)}),
        "VonMises": (lambda loc, k: dist.VonMises(loc, k), {"loc": _REAL, "k": _POSITIVE}, {"loc": torch.tensor(1.0), "k": torch.tensor(2.0)}),
        "MultivariateNormal LKJCholesky": (lambda loc, L: dist.MultivariateNormal(loc, scale_tril=L),
                                           {"loc": _REAL.expand([3]).to_event(1), "L": dist.LKJCholesky(3, 1.0)},
                                           {"loc": torch.zeros(3), "L": _TRIL}),
        "MultivariateNormal precision": (lambda loc, s: dist.MultivariateNormal(loc, precision_matrix=torch.diag(s) + 0.3),
                                         {"loc": _REAL.expand([2]).to_event(1), "s": _POSITIVE.expand([2]).to_event(1)},
                                         {"loc": torch.zeros(2), "s": torch.ones(2)}),
        "Uniform with a latent bound": (lambda hi: dist.Uniform(0.0, hi), {"hi": dist.Uniform(2.5, 5.0)},
                                        {"hi": torch.tensor(2.0)}),
        "masked": (lambda loc: dist.Normal(loc, 1.0).mask(torch.arange(20) % 3 > 0), {"loc": _REAL},
                   {"loc": torch.tensor(1.0)}),
    }.items()},
}


@pytest.mark.parametrize("name", list(_ZOO))
def test_traced_gradient_matches_eager_at_random_points(name):
    """Each distribution family as a prior (its transform to unconstrained space) and as a
    likelihood: the traced gradient, at one point and vmapped over a batch, equals Pyro's
    eager one at random points around the initial one. The graph passes rewrite what these
    log densities compute (broadcasts, sums, solves, softmaxes, products); a rewrite that
    changes a value shows here."""
    model, args = _ZOO[name]
    flat = from_model(model, args)
    engine = GradientEngine(flat)
    assert engine.name == "trace"
    gen = torch.Generator().manual_seed(1)
    points = [flat.initial_z + 1.5 * torch.randn(flat.dim, generator=gen) for _ in range(5)]
    _assert_engine_matches_eager(engine, points, torch.stack(points[:4]), rtol=1e-4, atol=1e-4)


def _assert_engine_matches_eager(engine, points, batch=None, **tolerance):
    """The engine's ``(U, dU/dz)`` equals eager autograd's at each point ``(D,)`` and, if
    given, for the batch ``(n, D)`` (the vmapped graph, against a loop over the points)."""
    for z in points:
        U, g = engine.value_and_grad(z)
        U_ref, g_ref = engine.eager_value_and_grad(z)
        assert torch.allclose(U, U_ref, **tolerance) and torch.allclose(g, g_ref, **tolerance)
    if batch is None:
        return
    U, g = engine.value_and_grad(batch)
    U_ref, g_ref = engine.flat.batched_value_and_grad(batch)
    assert U.shape == batch.shape[:1]
    assert torch.allclose(U, U_ref, **tolerance) and torch.allclose(g, g_ref, **tolerance)


def test_enumerated_discrete_model_traces():
    data = torch.tensor([-2.1, -1.9, 2.0, 2.2, 1.8])

    @pyro.infer.config_enumerate
    def mixture(data):
        loc = pyro.sample("loc", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        with pyro.plate("data", len(data)):
            k = pyro.sample("k", dist.Categorical(torch.tensor([0.5, 0.5])))
            pyro.sample("obs", dist.Normal(loc[k], 1.0), obs=data)

    flat = from_model(mixture, (data,), max_plate_nesting=1)
    engine = GradientEngine(flat)
    z = torch.tensor([-1.0, 1.0])
    U, g = engine.value_and_grad(z)
    U_ref, g_ref = engine.eager_value_and_grad(z)
    assert torch.allclose(U, U_ref, rtol=1e-5) and torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def test_fallback_kernel_still_samples_correctly():
    pyro.set_rng_seed(1)
    kernel = HMC(potential_fn=_latent_branch, step_size=0.3, num_steps=5)
    with pytest.warns(EngineFallbackWarning):
        mcmc = MCMC(kernel, num_samples=300, warmup_steps=100, disable_progbar=True,
                    initial_params={"x": torch.tensor([0.5, -0.2])})
        mcmc.run()
    assert kernel.engine_name == "eager"
    x = mcmc.get_samples()["x"]
    assert torch.isfinite(x).all() and x.std(0).min() > 0.2


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
def test_vectorized_chains_of_an_eager_model_advise_sequential_ones(chain_method):
    """Vectorized chains of a model on eager autograd evaluate its gradient chain by chain
    at every step of a round (~1.5x the time of sequential chains): the run says so, once."""

    def model():
        x = pyro.sample("x", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(x * (1 + 0 * x.item()), 1.0), obs=torch.tensor(1.0))

    pyro.set_rng_seed(0)
    mcmc = pyro_hmc_plus.MCMC(NUTS(model), num_samples=10, warmup_steps=10, num_chains=2, chain_method=chain_method,
                              disable_progbar=True, warn_on_problems=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mcmc.run()
    advice = [w for w in record if "chain_method='sequential'" in str(w.message)]
    assert len(advice) == (chain_method == "vectorized")
    assert all(w.category is EngineFallbackWarning and w.filename == __file__ for w in advice)


def test_programs_are_recorded_with_the_gradient_inlined():
    """A sampler function around the gradient graph becomes one TorchScript program that
    agrees with the eager function at other inputs."""
    flat = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    engine = GradientEngine(flat)

    def two_gradients(z, r):
        U1, g1 = engine.value_and_grad(z)
        U2, g2 = engine.value_and_grad(z + 0.1 * r)
        return U1 + U2, g1 - g2

    z, r = flat.initial_z, torch.randn(flat.dim)
    program = tracing.to_torchscript(two_gradients, (z, r))
    assert isinstance(program, torch.jit.ScriptFunction)
    z2, r2 = torch.randn(flat.dim), torch.randn(flat.dim)
    for a, b in zip(program(z2, r2), two_gradients(z2, r2)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


_QUADRATIC_FORM = torch.tensor([[2.0, 0.3, 0.0], [0.3, 1.0, 0.2], [0.0, 0.2, 0.5]])


@pytest.mark.parametrize("quadratic_form", [
    lambda x: 0.5 * x @ _QUADRATIC_FORM @ x,
    lambda x: 0.5 * (_QUADRATIC_FORM @ x.clone().unsqueeze_(1)).squeeze_(1).dot(x),
], ids=["x @ A @ x", "squeeze_"])
def test_an_op_that_reshapes_its_argument_in_place_traces(quadratic_form):
    """torch computes ``x @ A`` of a vector as the product of a one-row matrix, squeezed in
    place (``squeeze_``). The recorder kept the product's value, squeezed since, as its
    shape; a pass took the squeeze for a no-op, and ``0.5 * x @ A @ x`` (a Gaussian written
    by hand) failed its check and ran on eager autograd after a warning. Written by the user
    (``squeeze_(1)`` of the product), the passes failed with an ``IndexError``."""
    flat = from_potential_fn(lambda p: quadratic_form(p["x"]), {"x": torch.zeros(3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    assert engine.name == "trace"
    z = torch.tensor([0.3, -0.2, 0.5])
    U, g = engine.value_and_grad(z)
    assert torch.allclose(U, 0.5 * z @ _QUADRATIC_FORM @ z) and torch.allclose(g, _QUADRATIC_FORM @ z)


def test_a_failure_of_the_graph_passes_falls_back_to_eager_autograd(monkeypatch):
    """An error inside the passes that simplify the recorded graph (a bug of this package,
    like the one above) is no reason to stop the user's run: the model runs on eager
    autograd, after a warning that says so."""

    def failing(gm, recompile=True):
        raise IndexError("made to fail")

    monkeypatch.setattr(tracing, "simplify", failing)
    flat = from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.zeros(3)})
    with pytest.warns(EngineFallbackWarning, match=r"simplifying the traced graph failed \(IndexError: made to fail\)"):
        engine = GradientEngine(flat)
    assert engine.name == "eager"


def _branching_potential(evaluations: list, fail_beyond: float = math.inf):
    """A potential that cannot be traced (a Python ``if`` on ``.item()`` of a latent value):
    ``x**2`` halved or not by the sign of ``x[0]``; each evaluation appended to
    ``evaluations``, and a numerical failure (as a Cholesky's) where ``|x[0]|`` passes
    ``fail_beyond``."""

    def potential(p):
        x = p["x"]
        evaluations.append(1)
        if abs(x[0].item()) > fail_beyond:
            raise torch.linalg.LinAlgError("made to fail")
        return 0.5 * (x ** 2).sum() * (2.0 if x[0].item() > 0 else 1.0)

    return potential


def _two_leapfrog_like_steps(python_runs):
    """A sampler-like function of two gradients that counts its runs in Python."""

    def two_steps(value_and_grad, z, eps):
        python_runs.append(1)
        U1, g1 = value_and_grad(z)
        U2, g2 = value_and_grad(z - eps * g1)
        return U1 + U2, g2

    return two_steps


def test_programs_around_eager_autograd_call_it_as_one_operation():
    """On eager autograd the sampler's functions are still recorded, with the gradient as
    one operation of the program (which calls back into Python): a call runs the potential
    once per gradient, on both sides of its branch, and none of the function's Python, and
    gives what the function gives run in Python."""
    evaluations, python_runs = [], []
    flat = from_potential_fn(_branching_potential(evaluations), {"x": torch.tensor([0.5, -1.0])})
    with pytest.warns(EngineFallbackWarning, match="item"):
        engine = GradientEngine(flat)
    two_steps = _two_leapfrog_like_steps(python_runs)
    eps = torch.tensor(0.3)
    program = engine.program(two_steps, (torch.tensor([0.5, -1.0]), eps))
    runs, before = len(python_runs), len(evaluations)
    for z in (torch.tensor([0.5, -1.0]), torch.tensor([-0.7, 0.2])):
        U, g = program(z, eps)
        assert len(python_runs) == runs and len(evaluations) == before + 2
        expected_U, expected_g = two_steps(engine.eager_value_and_grad, z, eps)
        assert torch.allclose(U, expected_U) and torch.allclose(g, expected_g)
        runs, before = len(python_runs), len(evaluations)


def test_a_program_that_disagrees_with_its_function_is_recorded_around_eager_autograd(monkeypatch):
    """A recorded program that fails its check makes the engine fall back to eager
    autograd, like a model it cannot trace; that program too is then recorded around the
    eager gradient as one operation: its calls run none of the function's Python and give
    what the function gives on eager autograd."""
    check = GradientEngine._check

    def failing_traced_programs(self, program, cases, message):
        if self.name != "eager" and message == pyro_hmc_plus.engine._PROGRAM_MISMATCH:
            return "a mismatch made up by the test"
        return check(self, program, cases, message)

    monkeypatch.setattr(GradientEngine, "_check", failing_traced_programs)
    python_runs = []
    engine = GradientEngine(from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.tensor([0.5, -1.0])}))
    two_steps = _two_leapfrog_like_steps(python_runs)
    eps = torch.tensor(0.3)
    with pytest.warns(EngineFallbackWarning, match="a mismatch made up by the test"):
        program = engine.program(two_steps, (torch.tensor([0.5, -1.0]), eps))
    assert engine.name == "eager"
    runs = len(python_runs)
    for z in (torch.tensor([0.5, -1.0]), torch.tensor([-0.7, 0.2])):
        U, g = program(z, eps)
        assert len(python_runs) == runs
        expected_U, expected_g = two_steps(engine.eager_value_and_grad, z, eps)
        runs = len(python_runs)
        assert torch.allclose(U, expected_U) and torch.allclose(g, expected_g)


def test_a_program_that_fails_numerically_at_every_example_runs_on_eager_autograd():
    """Recording a program runs it once, at one example after another; where it fails
    numerically at all of them (a Cholesky beyond |z[0]| = 2), it runs on eager autograd
    with a warning, the engine stays traced for the rest, and the program gives what the
    function gives where it is defined. (The traced gradient itself gives NaN there rather
    than raising: its error checks are not recorded, and NaN is a divergence.)"""
    engine = GradientEngine(from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.tensor([0.5, -1.0])}))
    assert engine.name == "trace"

    def step_with_a_cholesky(value_and_grad, z, eps):
        U, g = value_and_grad(z)
        factor = torch.linalg.cholesky(torch.diag(torch.stack([torch.ones_like(z[0]), 4.0 - z[0] ** 2])))
        return U + factor.diagonal().log().sum(), z - eps * g

    eps, outside = torch.tensor(0.3), torch.tensor([3.0, 0.0])
    with pytest.warns(EngineFallbackWarning, match="failed numerically .* at every point where a sampler program"):
        program = engine.program(step_with_a_cholesky, (outside, eps), [(outside, eps), (outside + 1, eps)])
    assert engine.name == "trace"
    for z in (torch.tensor([0.5, -1.0]), torch.tensor([-0.7, 0.2])):
        U, z_next = program(z, eps)
        expected_U, expected_z = step_with_a_cholesky(engine.eager_value_and_grad, z, eps)
        assert torch.allclose(U, expected_U) and torch.allclose(z_next, expected_z)
    with pytest.raises(torch.linalg.LinAlgError):  # as the function fails: the sampler's divergence
        program(outside, eps)


def test_errors_inside_a_model_on_eager_autograd_come_out_of_its_programs_as_they_are():
    """Static Runtime, which runs the programs around the eager gradient, passes on what
    the model raises unchanged (TorchScript's interpreter turns any error into a
    ``RuntimeError``): a numerical failure is a divergence, and a ``KeyboardInterrupt``
    stops the run with the draws made so far."""
    evaluations = []
    kernel = NUTS(potential_fn=_branching_potential(evaluations, fail_beyond=1.5))
    pyro.set_rng_seed(0)
    with pytest.warns(EngineFallbackWarning, match="item"):
        mcmc = pyro_hmc_plus.MCMC(kernel, num_samples=300, warmup_steps=100, initial_params={"x": torch.zeros(2)},
                                  disable_progbar=True, warn_on_problems=False)
        mcmc.run()
    diverging = kernel.sample_stats[0]["diverging"]
    assert any(diverging) and not all(diverging)
    assert mcmc.get_samples()["x"][:, 0].abs().max() <= 1.5

    evaluations.clear()
    interrupt_at = 600
    potential = _branching_potential(evaluations)

    def interrupted(p):
        if len(evaluations) == interrupt_at:
            raise KeyboardInterrupt
        return potential(p)

    kernel = NUTS(potential_fn=interrupted, engine="eager")
    pyro.set_rng_seed(0)
    with pytest.warns(RuntimeWarning, match="sampling interrupted in chain 0 of 1"):
        mcmc = pyro_hmc_plus.MCMC(kernel, num_samples=1000, warmup_steps=50, initial_params={"x": torch.zeros(2)},
                                  disable_progbar=True)
        mcmc.run()
    assert 0 < len(mcmc.get_samples()["x"]) < 1000 and len(evaluations) == interrupt_at


@pytest.mark.parametrize("kernel_class", [NUTS, lambda model: HMC(model, num_steps=4)], ids=["NUTS", "HMC"])
def test_a_large_gradient_is_one_program_called_by_the_sampler_with_the_same_draws(kernel_class, monkeypatch):
    """A gradient of more than MAX_INLINED_GRADIENT_OPS operations (lowered here to below the
    AR(1) loop's) is not inlined into the kernel's programs (recording them would cost
    seconds): it is one traced program, which the kernel's programs call as one operation.
    The draws are those of the inlined programs."""
    y = torch.linspace(-1.0, 1.0, 10)

    def run(max_inlined_ops):
        monkeypatch.setattr(pyro_hmc_plus.engine, "MAX_INLINED_GRADIENT_OPS", max_inlined_ops)
        pyro.set_rng_seed(0)
        kernel = kernel_class(ar1_loop)
        mcmc = MCMC(kernel, num_samples=20, warmup_steps=20, disable_progbar=True)
        mcmc.run(y)
        return kernel._engine, mcmc.get_samples()

    engine, separate = run(10)
    assert engine.name == "trace" and engine.gradient_ops > 10
    assert list(engine._gradient_programs) == [(12,)]  # s, phi and 10 states, one point at a time
    engine, inlined = run(10**6)
    assert not engine._gradient_programs
    for name, value in inlined.items():
        assert torch.allclose(separate[name], value, atol=1e-4), name


def test_vectorized_chains_call_a_large_batched_gradient_with_the_same_draws(monkeypatch):
    """The same for the rounds of many chains at once (the threshold lowered here so that
    eight schools' small gradient counts as large)."""

    def run():
        pyro.set_rng_seed(0)
        mcmc = pyro_hmc_plus.MCMC(NUTS(eight_schools), num_samples=20, warmup_steps=20, num_chains=3,
                                  disable_progbar=True, warn_on_problems=False)
        mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
        return mcmc.kernel._engine, mcmc.get_samples(group_by_chain=True)

    engine, inlined = run()
    assert (3, 10) not in engine._gradient_programs
    monkeypatch.setattr(pyro_hmc_plus.engine, "MAX_INLINED_GRADIENT_OPS", 0)
    engine, separate = run()
    assert (3, 10) in engine._gradient_programs  # the 3 chains' points at once
    for name, value in inlined.items():
        assert torch.allclose(separate[name], value, atol=1e-4), name


WITHOUT_TORCHSCRIPT_SCRIPT = """
import pyro, pyro.distributions as dist, torch
import pyro_hmc_plus

def model(x):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=x)

pyro.set_rng_seed(0)
mcmc = pyro_hmc_plus.MCMC(pyro_hmc_plus.NUTS(model), num_samples=50, warmup_steps=50, num_chains=2,
                          disable_progbar=True)
mcmc.run(torch.arange(5.0))
print(mcmc.get_samples()["mu"].sum().item())
"""


def test_without_torchscript_the_programs_run_in_python_with_the_same_draws():
    """``PYTORCH_JIT=0``, torch's switch for debugging without TorchScript, makes
    ``torch.jit.trace`` hand back the function it was given: every run stopped with an
    ``AttributeError``. The sampler's programs now run in Python around the traced gradient
    graph, after one ``EngineFallbackWarning``, and draw what TorchScript's programs draw."""
    import os
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "PYTORCH_JIT"}

    def run(**switches):
        out = subprocess.run([sys.executable, "-c", WITHOUT_TORCHSCRIPT_SCRIPT], env={**env, **switches},
                             capture_output=True, text=True, check=True)
        return float(out.stdout), out.stderr

    with_torchscript, said = run()
    assert "EngineFallbackWarning" not in said
    without_torchscript, said = run(PYTORCH_JIT="0")
    assert said.count("EngineFallbackWarning") == 1 and "PYTORCH_JIT=0" in said
    assert abs(without_torchscript - with_torchscript) < 1e-4


def test_engine_programs_run_on_static_runtime_and_draws_reach_users_as_plain_tensors():
    """On the CPU the engine runs its programs with Static Runtime (inference tensors come
    out), yet a hook_fn, the samples and the eager potential get ordinary tensors: a hook may
    update them in place, autograd accepts them."""
    flat = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    engine = GradientEngine(flat)
    program = engine.program(lambda value_and_grad, z: value_and_grad(z), (flat.initial_z,),
                             [(flat.initial_z,), (flat.initial_z + 0.3,)])
    U, g = program(flat.initial_z)
    assert U.is_inference() and g.is_inference()
    U_eager, g_eager = flat.value_and_grad(g)  # an inference tensor as the eager potential's input
    assert torch.isfinite(U_eager) and not g_eager.is_inference()

    def hook(kernel, params, stage, i):
        for value in params.values():
            value.mul_(1.0)

    for kernel in (NUTS(eight_schools, max_tree_depth=3), HMC(eight_schools, num_steps=3)):
        mcmc = MCMC(kernel, num_samples=5, warmup_steps=5, hook_fn=hook, disable_progbar=True)
        mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
        assert not any(v.is_inference() for v in mcmc.get_samples().values())
    ours = pyro_hmc_plus.MCMC(NUTS(eight_schools, max_tree_depth=3), num_samples=5, warmup_steps=5, num_chains=2,
                hook_fn=hook, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplingWarning)  # 10 draws: the diagnostics complain
        ours.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    assert not any(v.is_inference() for v in ours.get_samples().values())


@pytest.mark.parametrize("escape", [
    lambda z: (z * float(z.sum()),),  # a Python number frozen into the trace
    lambda z: (torch.stack([x * 2 for x in z]),),  # iterating over a tensor
    lambda z: (z * len(z),),
])
def test_recording_refuses_values_that_would_be_frozen(escape):
    with pytest.raises(UntraceableModel, match="cannot be recorded"):
        tracing.to_torchscript(escape, (torch.randn(3),))


def _gamma_beta_poisson_loop(counts):
    """One Beta and one Gamma site per observation, in a Python loop: support checks, masks
    and comparisons (bool results and operands) among the repeated ops."""
    a = pyro.sample("a", dist.Gamma(2.0, 1.0))
    for i in range(len(counts)):
        p = pyro.sample(f"p_{i}", dist.Beta(a, 2.0))
        r = pyro.sample(f"r_{i}", dist.Gamma(a, 1.0))
        pyro.sample(f"c_{i}", dist.Poisson(r * p + 0.1), obs=counts[i])


def _vector_ar_loop(y):
    """A vector-valued AR(1) state per step (``Normal(...).to_event(1)``: sums over the last
    dimension) with a shared scale that every step's Normal broadcasts anew."""
    s = pyro.sample("s", dist.HalfNormal(1.0))
    x = torch.zeros(3)
    for t in range(y.shape[0]):
        x = pyro.sample(f"x_{t}", dist.Normal(0.9 * x, s).to_event(1))
        pyro.sample(f"y_{t}", dist.Normal(x, 0.3).to_event(1), obs=y[t])


def _stochastic_volatility_loop(returns):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(0.5))
    h = mu
    for t in range(len(returns)):
        h = pyro.sample(f"h_{t}", dist.Normal(mu + 0.9 * (h - mu), sigma))
        pyro.sample(f"r_{t}", dist.Normal(0.0, torch.exp(h / 2)), obs=returns[t])


def _recursive_volatility_loop(returns):
    """Non-centered: each step's state is computed from the last (a recursion), so each
    step's ops lie at a depth of their own."""
    mu = pyro.sample("mu", dist.Normal(0.0, 2.0))
    phi = pyro.sample("phi", dist.Uniform(-1.0, 1.0))
    sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
    h = mu
    for t in range(len(returns)):
        z = pyro.sample(f"z_{t}", dist.Normal(0.0, 1.0))
        h = mu + phi * (h - mu) + sigma * z
        pyro.sample(f"r_{t}", dist.Normal(0.0, torch.exp(h / 2)), obs=returns[t])


def _loop_of_matrix_sites(y):  # sites of one shape: rows of a block of the latent vector
    for i in range(len(y)):
        w = pyro.sample(f"w_{i}", dist.Normal(0.0, 1.0).expand([2, 3]).to_event(2))
        pyro.sample(f"y_{i}", dist.Normal((w ** 2).sum(), 1.0), obs=y[i])


@pytest.mark.parametrize("model, data, fewer", [
    (ar1_loop, torch.sin(torch.arange(30.0)), 5.0),
    (_gamma_beta_poisson_loop, torch.tensor([3.0, 5.0, 2.0, 4.0, 6.0, 1.0, 4.0, 3.0]), 1.4),
    (_vector_ar_loop, torch.cos(torch.arange(60.0)).reshape(20, 3), 2.5),
    (_stochastic_volatility_loop, 0.5 * torch.sin(torch.arange(30.0)), 5.0),
    (_recursive_volatility_loop, 0.5 * torch.sin(torch.arange(30.0)), 1.3),  # 1,093 -> 776
    (_loop_of_matrix_sites, torch.sin(torch.arange(6.0)), 1.3),  # 92 -> 63
], ids=["ar1", "gamma_beta_poisson", "vector_ar1", "stochastic_volatility", "recursion", "matrix_sites"])
def test_a_python_loop_of_sites_becomes_a_few_vector_ops_with_the_same_gradient(model, data, fewer, monkeypatch):
    """A model written as a Python loop of one site per step computes the same scalar ops for
    every step: vectorize_alike_ops computes them as vector ops. Fewer operations by the
    factor ``fewer`` (the AR(1) loop of 30 steps: at least 5x), the same potential and
    gradient as Pyro's at random points, one point at a time and for a batch of points (the
    vmap-ed graph)."""
    flat = from_model(model, (data,))
    engine = GradientEngine(flat)
    monkeypatch.setattr(tracing, "vectorize_alike_ops", lambda gm, recompile=True: gm)
    unvectorized = GradientEngine(flat)
    assert engine.name == unvectorized.name == "trace"
    assert engine.gradient_ops * fewer < unvectorized.gradient_ops
    gen = torch.Generator().manual_seed(1)
    points = flat.initial_z + torch.randn(4, flat.dim, generator=gen)
    U_batch, g_batch = engine.value_and_grad(points)
    for z, U_b, g_b in zip(points, U_batch, g_batch):
        U_ref, g_ref = flat.value_and_grad(z)
        for U, g in (engine.value_and_grad(z), (U_b, g_b)):
            assert torch.allclose(U, U_ref, rtol=1e-5) and torch.allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_a_sequential_plate_costs_the_same_operations_for_any_number_of_observations():
    """The vectorized steps of the potential's sum over the observations and of its
    gradient's (one group of four sums, each step's terms picked from one concatenation)
    become one sum each, instead of a chain of an ``index_select`` and an add per
    observation: 2,075 operations for 1,000 observations, now 87 for any number."""
    ops = []
    for n in (20, 60):
        gen = torch.Generator().manual_seed(n)
        x = torch.randn(n, generator=gen)
        y = 1.0 + 2.0 * x + 0.5 * torch.randn(n, generator=gen)
        flat = from_model(sequential_plate_regression, (x, y))
        engine = GradientEngine(flat)
        ops.append(engine.gradient_ops)
        for z in flat.initial_z + torch.randn(3, flat.dim, generator=gen):
            (U, g), (U_ref, g_ref) = engine.value_and_grad(z), flat.value_and_grad(z)
            assert torch.allclose(U, U_ref, rtol=1e-5) and torch.allclose(g, g_ref, rtol=1e-4, atol=1e-4)
    assert ops[0] == ops[1] < 100


def test_a_long_loop_vectorized_first_is_not_also_folded_without_it(monkeypatch):
    """Where vectorizing first leaves a small fraction of a loop's operations, the trace takes
    it without folding the unvectorized graph and vectorizing that again (seconds of setup
    for a loop of 1,000 sites, never a smaller graph on the test suite's models): the
    loop is vectorized once, and the gradient has as few operations as before."""
    gen = torch.Generator().manual_seed(60)
    x = torch.randn(60, generator=gen)
    flat = from_model(sequential_plate_regression, (x, 1.0 + 2.0 * x + 0.5 * torch.randn(60, generator=gen)))
    graphs = []
    vectorize = tracing.vectorize_alike_ops
    monkeypatch.setattr(tracing, "vectorize_alike_ops",
                        lambda gm, recompile=True: graphs.append(tracing.cost(gm.graph)) or vectorize(gm, recompile))
    engine = GradientEngine(flat)
    assert len(graphs) == 1 and graphs[0] > 400  # the recorded loop, vectorized once
    assert engine.gradient_ops < 100


def test_a_sum_of_blocks_of_rows_of_one_tensor_is_one_sum():
    """Terms ``x.index_select(0, idx_k)`` added up, each a block of the same number of rows
    (one row: shape ``(1, 2)``; two rows: ``(2, 2)``), become one ``index_select`` of all their
    rows, a view with one block per term and one sum, of the terms' shape."""
    singles = [torch.tensor([i]) for i in (0, 2, 3)]
    pairs = [torch.tensor(p) for p in ((0, 1), (4, 2), (3, 3))]

    def fn(x):
        one = x.index_select(0, singles[0]) + x.index_select(0, singles[1]) + x.index_select(0, singles[2])
        two = x.index_select(0, pairs[0]) + x.index_select(0, pairs[1]) + x.index_select(0, pairs[2])
        return one, two

    gm = tracing._record(fn, (torch.randn(5, 2),))  # values, not make_fx's fake tensors, in the nodes
    before = tracing.operations(gm.graph)
    tracing._sum_rows_at_once(gm.graph, {})
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert tracing.operations(gm.graph) == before - 4  # 5 ops -> 3 (index_select, view, sum), twice
    x = torch.randn(5, 2)
    for a, b in zip(gm(x), fn(x)):
        assert a.shape == b.shape and torch.allclose(a, b)


def _random_loop_gradient(seed: int):
    """``(fn, number of steps)``: the value and gradient of a random loop, the shape of a
    model's potential written as a Python loop of sites: every step applies the same random
    ops to its own element of ``x`` (and its neighbour's), a shared number and, in a
    recursion, the last step's state; the steps' results are summed, stacked, and sometimes
    written into a buffer in place."""
    rng = random.Random(seed)
    steps = rng.randint(3, 30)
    body = [(rng.choice(["mul", "add", "sub", "exp", "tanh", "mul_number", "add_number", "square", "div", "log1p"]),
             rng.randrange(4), rng.randrange(4), rng.choice([0.5, -1.0, 2.0, 0.0])) for _ in range(rng.randint(2, 8))]
    recursion, in_place, returned = rng.random() < 0.5, rng.random() < 0.2, rng.choice(["sum", "stack", "both"])

    def loop(x, s):
        state, total, rows = s[0], s[1] * 0.0, []
        written = torch.zeros(steps) if in_place else None
        for k in range(steps):
            values = [x[k], s[1], state, x[(k + 1) % steps]]
            for kind, i, j, c in body:
                a, b = values[i], values[j]
                values.append({"mul": lambda: a * b, "add": lambda: a + b, "sub": lambda: a - b,
                               "exp": lambda: torch.exp(torch.tanh(a)), "tanh": lambda: torch.tanh(a),
                               "mul_number": lambda: a * c, "add_number": lambda: a + c, "square": lambda: a * a,
                               "div": lambda: a / (1.0 + b * b), "log1p": lambda: torch.log1p(a * a)}[kind]())
            if recursion:
                state = torch.tanh(values[-1])
            total = total + values[-1]
            rows.append(values[-2])
            if in_place:
                written[k] = values[-1]
        out = [total] if returned != "stack" else []
        out += [torch.stack(rows)] if returned != "sum" else []
        return out + ([written.sum()] if in_place else [])

    def value_and_grad(x, s):
        x, s = x.detach().requires_grad_(), s.detach().requires_grad_()
        value = sum(o.sum() for o in loop(x, s))
        gx, gs = torch.autograd.grad(value, (x, s), allow_unused=True)
        return value.detach(), torch.zeros_like(x) if gx is None else gx, torch.zeros_like(s) if gs is None else gs

    return value_and_grad, steps


def test_traced_random_loops_keep_their_values_and_gradients():
    """Property check of the whole tracing pipeline (the folds and the vectorizer) on 60
    random loops with their gradients (when the sums over a loop's steps became one op,
    1,500 such loops without gradients and 500 with agreed; a concatenation shared by groups
    that pick from different tensors fails it)."""
    gen = torch.Generator().manual_seed(0)
    for seed in range(60):
        fn, steps = _random_loop_gradient(seed)
        gm = tracing.trace(fn, (torch.randn(steps, generator=gen), torch.randn(2, generator=gen)), check_escapes=False)
        inputs = torch.randn(steps, generator=gen), torch.randn(2, generator=gen)
        for traced, direct in zip(gm(*inputs), fn(*inputs)):
            assert torch.allclose(traced, direct, rtol=1e-4, atol=1e-4, equal_nan=True), seed


@pytest.mark.parametrize("chains", [1, 4])
def test_programs_call_the_gradient_recorded_once_per_shape(monkeypatch, chains):
    """The sampler's programs (NUTS, one chain and vectorized chains) are recorded calling
    the gradient as a TorchScript function recorded once per shape of ``z``, not by running
    the gradient graph op by op under the recorder at each of their dozens of calls (half of
    their recording time). The same draws either way: the programs are inlined."""
    during_recordings = []
    value_and_grad = GradientEngine.value_and_grad

    def counted(self, z):
        if torch._C._get_tracing_state() is not None:
            during_recordings.append(z)
        return value_and_grad(self, z)

    monkeypatch.setattr(GradientEngine, "value_and_grad", counted)
    pyro.set_rng_seed(0)
    mcmc = pyro_hmc_plus.MCMC(NUTS(eight_schools), num_samples=30, warmup_steps=30, num_chains=chains,
                              disable_progbar=True, warn_on_problems=False)
    mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    engine = mcmc.kernel._engine
    assert engine.name == "trace" and engine._gradient_functions
    assert len(during_recordings) == len(engine._gradient_functions)  # each function's own recording


def test_a_trace_generates_python_code_once(monkeypatch):
    """The passes rewrite graphs that no one runs until the trace is finished; generating
    their Python code at every copy and every round of the vectorizer took ~6 of the 19 s
    that a 200-step hidden Markov model's trace took (13 generations)."""
    generated = []
    recompile = torch.fx.GraphModule.recompile

    def counted(self):
        generated.append(self)
        return recompile(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    engine = GradientEngine(from_model(_recursive_volatility_loop, (0.5 * torch.sin(torch.arange(30.0)),)))
    assert engine.name == "trace" and len(generated) == 1


def test_vectorizing_is_kept_only_where_the_finished_graph_is_smaller(monkeypatch):
    """A round of vectorize_alike_ops counts its own savings, but the passes after it may
    then fold less: on the recursion, grouping by depth alone gave 1,201 operations where
    none gave 1,093. The trace keeps whichever finished graph is smaller."""
    flat = from_model(_recursive_volatility_loop, (0.5 * torch.sin(torch.arange(30.0)),))
    monkeypatch.setattr(tracing, "_groups_of_independent_ops", lambda nodes, candidates: [])
    by_depth = GradientEngine(flat)
    monkeypatch.setattr(tracing, "vectorize_alike_ops", lambda gm, recompile=True: gm)
    assert by_depth.gradient_ops <= GradientEngine(flat).gradient_ops


def test_a_recursion_is_also_vectorized_after_the_linear_folds():
    """The folds can make a loop's steps alike that were not before them (each step's
    constants composed the same way): the trace also vectorizes the folded graph and keeps
    whichever finished graph is smallest. The 30-step volatility recursion: 776 operations
    when only the graph before the folds was vectorized, 571 now."""
    flat = from_model(_recursive_volatility_loop, (0.5 * torch.sin(torch.arange(30.0)),))
    engine = GradientEngine(flat)
    assert engine.gradient_ops <= 600
    gen = torch.Generator().manual_seed(0)
    points = [flat.initial_z + torch.randn(flat.dim, generator=gen) for _ in range(3)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-4, atol=1e-4)


def test_an_op_repeated_on_the_same_inputs_is_computed_once():
    """merge_duplicate_ops: the same op on the same inputs runs once, unless its result is
    written in place (then each stays a tensor of its own)."""

    def fn(x, s):
        a = s.expand(3) * x
        b = s.expand(3) * x  # the same twice
        kept = s.expand(3) * 1.5
        written = s.expand(3) * 1.5  # equal to kept, but written in place below (through a view)
        written[:2].add_(x[:2])
        return a + b + kept, written

    x, s = torch.randn(3), torch.tensor(2.0)
    gm = tracing.trace(fn, (x, s), check_escapes=False)
    targets = [node.target for node in gm.graph.nodes]
    assert targets.count(torch.ops.aten.expand.default) == 1
    assert targets.count(torch.ops.aten.mul.Tensor) == 3  # a (= b), kept, written
    for _ in range(3):
        x, s = torch.randn(3), torch.randn(())
        for a, b in zip(gm(x, s), fn(x, s)):
            assert torch.allclose(a, b)


def test_no_op_is_computed_twice_after_the_last_pass():
    """The passes after merge_duplicate_ops (folding linear chains, taking numbers out of
    sums) can make two ops alike (the hierarchical model's gradient had ``sigma_y ** 2``
    twice): the trace merges again at the end."""
    from pyro_hmc_plus.models import hierarchical_intercepts

    gen = torch.Generator().manual_seed(0)
    group = torch.arange(8).repeat_interleave(5)
    x, y = torch.randn(40, generator=gen), torch.randn(40, generator=gen)
    engine = GradientEngine(from_model(hierarchical_intercepts, (x, group, y)))
    keys = [(n.target, tracing._hashable(n.args), tracing._hashable(n.kwargs))
            for n in engine._graph.graph.nodes if n.op == "call_function"]
    assert len(keys) == len(set(keys))


def test_small_constants_equal_bit_for_bit_are_one_constant():
    """Each step of a loop makes its own constants (``0.9``, the folded ``1 / 0.3 ** 2``):
    merged, the ops reading them merge too, and the vectorizer sees one shared operand (the
    vector AR(1) loop of the test above: 343 -> 166 operations). ``-0.0`` is not ``0.0``
    (``atan2`` tells them apart), so it stays apart."""

    def fn(x):
        a = torch.atan2(torch.tensor(0.9), x)
        b = torch.atan2(torch.tensor(0.9), x)  # the same op on an equal constant: computed once
        c = torch.atan2(torch.tensor(0.0), x)
        d = torch.atan2(torch.tensor(-0.0), x)  # -pi where c is pi
        return a * b, c, d

    x = torch.tensor([0.5, -2.0, 3.0])
    gm = tracing.trace(fn, (x,), check_escapes=False)
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.aten.atan2.default) == 3
    for _ in range(3):
        for actual, expected in zip(gm(x.clone()), fn(x)):
            torch.testing.assert_close(actual, expected)
        x = torch.randn(3)


def test_sums_and_concatenations_of_vectorized_rows_become_one_op_each():
    """Six alike chains picked from an input by negative indices, summed with a number in
    between, and concatenated: one vector chain, one sum, one index_select."""

    def fn(x):
        parts = [(x[-i - 1] * 3.0).exp() + 2.0 for i in range(6)]
        total = parts[0] + parts[1] + 1.5 + parts[2] + parts[3] + parts[4] + parts[5]
        return total, torch.cat([p.reshape(1) for p in parts])

    gm = tracing.trace(fn, (torch.randn(6),), check_escapes=False)
    assert tracing.operations(gm.graph) <= 8
    for _ in range(3):
        x = torch.randn(6)
        for a, b in zip(gm(x), fn(x)):
            assert torch.allclose(a, b, rtol=1e-6)


_ODE_TIMES = torch.linspace(0.5, 3.0, 6)


def _linear_ode(y):
    """A damped oscillator x(t) = expm(A t) x0 observed at six times, the solution of a linear
    ODE (compartment models of pharmacokinetics are of this kind)."""
    decay = pyro.sample("decay", dist.Normal(0.0, 1.0))
    freq = pyro.sample("freq", dist.Normal(0.0, 2.0))
    A = torch.stack([torch.stack([decay, freq]), torch.stack([-freq, decay])])
    x = torch.stack([torch.linalg.matrix_exp(A * t) @ torch.tensor([1.0, 0.0]) for t in _ODE_TIMES])
    pyro.sample("y", dist.Normal(x, 0.1).to_event(2), obs=y)


def test_matrix_exponentials_at_several_times_are_one_batched_call(monkeypatch):
    """torch's matrix exponential costs ~150 us a call even for a 2 x 2 matrix: the six of the
    potential, and the six of its gradient, are one batched call each, counted as the
    expensive ops they are (a vectorized round adds a stack and six selects); the same
    potential and gradient as Pyro's at random points."""
    y = torch.stack([torch.exp(-0.3 * t) * torch.stack([torch.cos(t), -torch.sin(t)]) for t in _ODE_TIMES])
    flat = from_model(_linear_ode, (y,))

    def matrix_exps(engine):
        return sum(n.target is torch.ops.aten.linalg_matrix_exp.default for n in engine._graph.graph.nodes)

    engine = GradientEngine(flat)
    monkeypatch.setattr(tracing, "vectorize_alike_ops", lambda gm, recompile=True: gm)
    unvectorized = GradientEngine(flat)
    assert engine.name == unvectorized.name == "trace"
    assert (matrix_exps(engine), matrix_exps(unvectorized)) == (2, 12)
    gen = torch.Generator().manual_seed(1)
    for z in flat.initial_z + 0.5 * torch.randn(3, flat.dim, generator=gen):
        U_ref, g_ref = flat.value_and_grad(z)
        U, g = engine.value_and_grad(z)  # (float32: the residuals over 0.1 amplify rounding)
        assert torch.allclose(U, U_ref, rtol=1e-4) and torch.allclose(g, g_ref, rtol=1e-4, atol=1e-3)


def test_vectorized_ops_keep_their_order_around_in_place_writes(monkeypatch):
    """Alike ops are reordered when computed at once; an in-place write keeps its place
    between the reads before it and those after it, and a result written in place stays a
    tensor of its own (``x[:3] * 1.0`` was once replaced by the view ``x[:3]``, so the write
    went into the caller's ``x``)."""

    def fn(x):
        buffer = x[:3] * 1.0
        parts = [(x[i] * 3.0).exp() for i in range(6)]
        before = buffer * parts[0]  # reads the buffer before it is written
        buffer.add_(x[3:])
        after = buffer * parts[5]  # and after
        return torch.stack(parts).sum() + before.sum() + after.sum(), buffer

    gm = tracing.trace(fn, (torch.randn(6),), check_escapes=False)
    for _ in range(3):
        x = torch.randn(6)
        before = x.clone()
        for a, b in zip(gm(x), fn(x.clone())):
            assert torch.allclose(a, b, rtol=1e-6), (a, b)
        assert torch.equal(x, before)
    monkeypatch.setattr(tracing, "vectorize_alike_ops", lambda gm, recompile=True: gm)
    unvectorized = tracing.trace(fn, (torch.randn(6),), check_escapes=False)
    assert tracing.operations(gm.graph) <= tracing.operations(unvectorized.graph) - 10  # 6 x (select, mul, exp)


def test_linear_chains_fold_into_fewer_ops_with_the_same_values():
    c = torch.tensor([1.0, 2.0, 3.0])

    def fn(x, y):
        affine = ((x - c) / 2.0 * 3.0 + 4.0).exp()  # one addcmul, then exp
        shared = x * 5.0  # used twice: must stay
        total = -(shared.sum() + y.sum() - 7.0 + (2.0 * y).sum())  # several terms, one constant
        return affine + shared, total

    x, y = torch.randn(3), torch.randn(4)
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(x, y)
    before = sum(n.op == "call_function" for n in gm.graph.nodes)
    tracing.fold_linear_chains(gm)
    after = sum(n.op == "call_function" for n in gm.graph.nodes)
    # the affine chain (4 ops) becomes one addcmul; add, sub, add, neg over three sums become
    # two adds and one addcmul
    assert after == before - 4
    for _ in range(3):
        x, y = torch.randn(3), torch.randn(4)
        for a, b in zip(gm(x, y), fn(x, y)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_a_long_sum_of_linear_terms_folds_into_one_chain_with_the_same_value():
    """A potential that adds hundreds of log densities one by one (a sample site per row, in a
    Python loop) is a chain of hundreds of additions, each term with its own constants: one
    form, one constant, one addition per term."""
    n = 500

    def fn(x):
        total = x[0] * 0.25
        for i in range(n):
            total = total + ((x[i] - 1.0) / 2.0 - 0.5)  # three linear ops per term
        return -total

    x = torch.randn(n)
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(x)
    tracing.fold_linear_chains(gm)
    # n selects (x[0] is selected twice), n adds, and the scale and constant in one addcmul
    assert tracing.operations(gm.graph) == 2 * n + 2
    for _ in range(3):
        x = torch.randn(n)
        assert torch.allclose(gm(x), fn(x), rtol=1e-5, atol=1e-4)


def _random_linear_program(seed: int):
    """A function of three vectors: a random sequence of adds (with ``alpha``), subtractions,
    products and quotients by numbers (zero among them), negations, products by a constant
    vector and a non-linear op, reading earlier results at random (so some are read twice),
    returning some of them."""
    rng = random.Random(seed)
    steps, count = [], 3
    for _ in range(rng.randint(3, 40)):
        steps.append((rng.choice(["add", "sub", "mul", "div", "neg", "add_number", "add_alpha", "mul_vector", "tanh"]),
                      rng.randrange(count), rng.randrange(count), rng.choice([0.0, 1.0, -1.0, 2.5, 0.5, -3.0])))
        count += 1
    returned = sorted({rng.randrange(count) for _ in range(rng.randint(1, 3))} | {count - 1})
    weights = torch.tensor([1.0, 2.0, 0.0])

    def fn(x, y, z):
        values = [x, y, z]
        for kind, i, j, c in steps:
            a, b = values[i], values[j]
            values.append({"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * c,
                           "div": lambda: a / (c or 2.0), "neg": lambda: -a, "add_number": lambda: a + c,
                           "add_alpha": lambda: torch.add(a, b, alpha=c), "mul_vector": lambda: a * weights,
                           "tanh": lambda: torch.tanh(a)}[kind]())
        return tuple(values[k] for k in returned)

    return fn


def test_folded_linear_chains_of_random_programs_keep_their_values():
    """Property check of :func:`tracing.fold_linear_chains` on 300 random programs (it found
    the zero coefficient taken as the scale of a sum: 6 of these 300 gave NaN)."""
    gen = torch.Generator().manual_seed(0)
    for seed in range(300):
        fn = _random_linear_program(seed)
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(*torch.randn(3, 3, generator=gen))
        tracing.fold_linear_chains(gm)
        inputs = torch.randn(3, 3, generator=gen)
        for folded, direct in zip(gm(*inputs), fn(*inputs)):
            assert torch.allclose(folded, direct, rtol=1e-4, atol=1e-4, equal_nan=True), seed


def test_a_term_multiplied_by_zero_is_not_the_scale_of_a_folded_sum():
    """``x * 0 + 2 * y + 1``: the folded sum writes each term's coefficient relative to one
    term's; a zero one would make the others infinite (the sum was NaN)."""

    def fn(x, y):
        return x * 0.0 + y * 2.0 + 1.0, (x * 0.0 - y * 0.0) * 3.0

    x, y = torch.randn(3), torch.randn(3)
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(x, y)
    tracing.fold_linear_chains(gm)
    for _ in range(3):
        x, y = torch.randn(3), torch.randn(3)
        for a, b in zip(gm(x, y), fn(x, y)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_reordering_a_graph_deeper_than_pythons_recursion_limit():
    """A model with a thousand observation sites in a Python loop (``for i in pyro.plate(...)``)
    sums their log densities in a chain of a thousand adds; ordering the graph followed that
    chain by recursion and raised ``RecursionError`` from inside the kernel's setup."""
    import sys

    depth = sys.getrecursionlimit() + 500

    def fn(x):
        for _ in range(depth):
            x = x + 1.0
        return x

    gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(torch.zeros(2))
    assert tracing._reorder(gm.graph, {})
    gm.recompile()
    assert torch.equal(gm(torch.zeros(2)), torch.full((2,), float(depth)))


def test_constants_get_fresh_names_when_a_pass_runs_again():
    """The passes name the constants they make ``{prefix}{i}``; a second pass, or a name taken
    by another, must never overwrite one still in use."""
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    first = [tracing._constant_node(gm, "_c_", torch.tensor(float(i))) for i in range(3)]
    gm.register_buffer("_c_3", torch.tensor(30.0))  # taken by someone else
    later = [tracing._constant_node(gm, "_c_", torch.tensor(float(i))) for i in range(4, 6)]
    assert [n.target for n in first + later] == ["_c_0", "_c_1", "_c_2", "_c_4", "_c_5"]
    assert [float(getattr(gm, f"_c_{i}")) for i in range(6)] == [0.0, 1.0, 2.0, 30.0, 4.0, 5.0]


def test_a_trace_that_disagrees_with_pyro_falls_back_to_eager():
    """A potential whose value depends on Python state the trace cannot see (here a call
    counter): the trace freezes it, the check against Pyro's potential catches it."""
    calls = [0]

    def stateful(p):
        calls[0] += 1
        return (p["x"] ** 2).sum() * (1.0 + 0.5 * (calls[0] % 2))

    flat = from_potential_fn(stateful, {"x": torch.tensor([0.5, -0.2])})
    with pytest.warns(EngineFallbackWarning, match="disagrees with Pyro's eager potential"):
        engine = GradientEngine(flat)
    assert engine.name == "eager"


def test_large_float32_potentials_keep_the_traced_programs():
    """|U| ~ 4000 in float32 (a normalising constant, as the sum over many observations
    gives): the folded gradient graph rounds U differently from Pyro by an ulp (~5e-4),
    which is nothing for U but as much as a whole energy difference H0 - H of a leapfrog
    step. Programs are therefore checked against the sampler function on the traced
    gradient, not against Pyro, and the kernel stays on the traced engine."""
    from pyro_hmc_plus import NUTS

    def offset_gaussian(p):
        return 0.5 * ((p["x"] - 1.0) ** 2).sum() + 4321.37 - 0.61 + 0.77

    flat = from_potential_fn(offset_gaussian, {"x": torch.zeros(5)})
    engine = GradientEngine(flat)
    gen = torch.Generator().manual_seed(3)
    points = [torch.randn(5, generator=gen) for _ in range(20)]
    rounding = max((engine.value_and_grad(z)[0] - flat.value_and_grad(z)[0]).abs().item() for z in points)
    assert rounding > 1e-4  # what a whole-program check against Pyro would have seen

    kernel = NUTS(potential_fn=offset_gaussian)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        mcmc = MCMC(kernel, num_samples=200, warmup_steps=100, disable_progbar=True,
                    initial_params={"x": torch.zeros(5)})
        mcmc.run()
    assert kernel.engine_name == "trace"
    x = mcmc.get_samples()["x"].numpy()
    assert_mean(x, 1.0)
    assert_variance(x, 1.0)


def test_permutations_of_unit_dimensions_become_reshapes():
    """The 2-D Gaussian's gradient views z as a (1, 2, 1) column through a permutation of
    unit dimensions, and back: no permutation remains (once the constant solves are
    products, only the potential's column view is left), with the same values."""
    flat = from_model(gauss2d)
    engine = GradientEngine(flat)
    targets = [n.target for n in engine._graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.permute.default not in targets
    assert targets.count(torch.ops.aten.reshape.default) == 1
    for _ in range(3):
        z = torch.randn(2)
        for a, b in zip(engine.value_and_grad(z), flat.value_and_grad(z)):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_permutations_of_permutations_compose():
    """The gradient of ``Z @ W.T`` (probabilistic PCA, a linear layer) transposes W's
    gradient back: ``t`` after ``t`` (or a ``permute`` that undoes a ``transpose``) is no op,
    and a chain of permutations is one; the values and their layout stay."""

    def fn(w, x):
        y = (x @ w.t()).t().permute(1, 0)  # cancels: x @ w.T
        u = x.reshape(2, 3, 10).permute(2, 0, 1).transpose(0, 1)  # one permute: (0, 2, 1)
        return y.exp(), u * 2, w.t().t() + 1

    w, x = torch.randn(5, 6), torch.randn(10, 6)
    gm = tracing.trace(fn, (w, x), check_escapes=False)
    permutes = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.permute.default, torch.ops.aten.t.default,
                                                         torch.ops.aten.transpose.int)]
    assert [(n.target, n.args[1:]) for n in permutes] == [
        (torch.ops.aten.t.default, ()),  # the product's own w.T
        (torch.ops.aten.permute.default, ([0, 2, 1],)),
    ]
    for ours, eager in zip(gm(w, x), fn(w, x)):
        assert ours.shape == eager.shape and ours.stride() == eager.stride()
        assert torch.equal(ours, eager)


def test_solves_against_constant_matrices_become_one_product():
    """The 2-D Gaussian's gradient solves with its constant Cholesky factor forward and back,
    on z viewed as a column: one matrix-vector product with the composed constant matrix (the
    precision matrix) instead, with the same values; the potential keeps its own product."""
    flat = from_model(gauss2d)
    engine = GradientEngine(flat)
    targets = [n.target for n in engine._graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.linalg_solve_triangular.default not in targets
    assert targets.count(torch.ops.aten.mv.default) == 2  # U's L^-1 z and the gradient's P z
    assert engine._graph.graph.output_node().args[0][1].target is torch.ops.aten.mv.default  # nothing after it
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        z = torch.randn(2, generator=gen) * 3
        U, g = engine.value_and_grad(z)
        U_ref, g_ref = flat.value_and_grad(z)
        assert torch.allclose(U, U_ref, rtol=1e-6, atol=1e-6)
        assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-5)
        assert torch.allclose(g, PRECISION @ z, rtol=1e-5, atol=1e-5)


def test_solves_against_ill_conditioned_constants_stay_solves():
    """An explicit inverse of a badly conditioned matrix loses the accuracy a solve keeps:
    such solves are left alone (cond(A) * eps above 1e-5 in the graph's dtype)."""
    well = torch.tensor([[2.0, 0.0], [1.0, 1.5]])
    ill = torch.tensor([[1.0, 0.0], [1.0, 1e-4]])

    def fn(x):
        a = torch.linalg.solve_triangular(well, x.unsqueeze(-1), upper=False)
        b = torch.linalg.solve_triangular(ill, x.unsqueeze(-1), upper=False)
        return a.sum() + b.sum()

    x = torch.randn(2)
    gm = tracing.trace(fn, (x,), check_escapes=False)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.linalg_solve_triangular.default) == 1
    assert torch.allclose(gm(x), fn(x), rtol=1e-6, atol=1e-6)


def test_solves_whose_results_are_column_major_keep_their_layout_as_products():
    """A multivariate normal latent in a plate (varying intercepts and slopes): its solves
    return column-major batches, and the gradient's views and elementwise ops were recorded
    with that layout; the products replacing the solves are laid out the same, so the traced
    gradient runs (it failed with 'view size is not compatible', and the model fell back to
    eager autograd) and agrees with Pyro's."""
    scale_tril = torch.tensor([[1.0, 0.0], [0.5, 1.0]])
    group = torch.arange(40) % 5
    x = torch.linspace(-1, 1, 40)

    def varying_slopes(y):
        with pyro.plate("groups", 5):
            ab = pyro.sample("ab", dist.MultivariateNormal(torch.zeros(2), scale_tril=scale_tril))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(ab[group, 0] + ab[group, 1] * x, 1.0), obs=y)

    flat = from_model(varying_slopes, (torch.sin(3 * x),))
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    targets = [n.target for n in engine._graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.linalg_solve_triangular.default not in targets
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        z = torch.randn(10, generator=gen) * 2
        for ours, pyros in zip(engine.value_and_grad(z), flat.value_and_grad(z)):
            assert torch.allclose(ours, pyros, rtol=1e-5, atol=1e-5)


NO_DYNAMO_SCRIPT = """
import sys, torch, pyro, pyro.distributions as dist
from pyro.infer import MCMC
from pyro_hmc_plus import NUTS, MCMC as VectorizedMCMC

def model():
    x = pyro.sample("x", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    pyro.sample("w", dist.Dirichlet(torch.ones(3)))  # its gradient has a log_sigmoid_backward
    with pyro.plate("data", 4):  # observed data: the setup's check of their shapes
        pyro.sample("y", dist.Normal(x.sum(), 1.0), obs=torch.zeros(4))

MCMC(NUTS(model), num_samples=5, warmup_steps=5, disable_progbar=True).run()
VectorizedMCMC(NUTS(model), num_samples=5, warmup_steps=5, num_chains=2, disable_progbar=True,
               warn_on_problems=False).run()
print("torch._dynamo" in sys.modules, "sympy" in sys.modules)
"""


def test_the_default_engine_never_imports_dynamo_or_sympy():
    """Setting up the kernel, recording the gradient and the programs (one chain, and
    batched chains) must not import ``torch._dynamo`` or ``sympy``: those imports are ~1.5 s
    and ~0.5 s of every fresh process, a third and a quarter of a short NUTS run (eight
    schools). Fails if a torch upgrade brings one back (see tracing._AtenRecorder), or if
    the package calls a torch function that imports them (``torch.unravel_index`` and
    ``torch.broadcast_shapes`` did, the latter twice: the second time in the setup's check of
    observed data, which this model's ``y`` now reaches)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", NO_DYNAMO_SCRIPT], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False False"


@pytest.mark.parametrize("a, b", [((3,), (3,)), ((2, 1), (1, 4)), ((), (5,)), ((4, 1, 3), (2, 1)), ((0,), (1,)),
                                  ((1,), (0,)), ((3,), (4,)), ((2, 3), (3, 2))])
def test_broadcast_shape_is_torchs(a, b):
    """``tracing.broadcast_shape`` (``torch.broadcast_shapes`` without its import of
    sympy) gives torch's shape, and ``None`` where torch refuses."""
    try:
        expected = torch.broadcast_shapes(a, b)
    except RuntimeError:
        expected = None
    assert tracing.broadcast_shape(a, b) == expected


def _in_place_potential(p):
    """In-place updates of tensors computed from the latents, on the tensor and on a view."""
    x = p["x"]
    y = x * 2.0
    y.add_(1.0)
    y[0] = y[0] * 3.0  # a copy into a view of y
    w = torch.zeros(3)
    w.copy_(x.exp())
    return (y**2).sum() + w.sum()


def _buffer_filled_in_place_potential(p):
    x = p["x"]
    probs = torch.zeros(3)  # filled in place, then read: as Pyro's OrderedLogistic does
    probs[0] = torch.sigmoid(x[0])
    probs[1:] = torch.exp(x[1:])
    return -(probs / probs.sum()).log().sum()


def _tensor_updated_in_place_potential(p):
    x = p["x"]
    offset = torch.tensor([1.0, 2.0, 3.0])  # a new tensor at every run of the model
    offset[0] += x.sum()
    offset.mul_(x)
    return 0.5 * (offset**2).sum()


@pytest.mark.parametrize("potential", [_in_place_potential, _buffer_filled_in_place_potential,
                                       _tensor_updated_in_place_potential])
def test_in_place_updates_are_recorded_in_order(potential):
    """The recorder follows a tensor through in-place ops and writes into its views: the
    graph agrees with eager autograd at fresh points (no fallback), one point and a batch,
    and again at the first point. A tensor made from constants (``zeros``,
    ``torch.tensor``) and then written in place is not a constant: folding it gave its value
    before the writes to later readers (NaN: ``probs.sum()`` was 0), and a ``torch.tensor``
    written in place kept one call's writes for the next (and the trace's own writes from
    the start); both are made afresh at each call."""
    flat = from_potential_fn(potential, {"x": torch.tensor([0.3, -0.5, 1.0])})
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    gen = torch.Generator().manual_seed(3)
    points = [torch.randn(3, generator=gen) for _ in range(3)]
    _assert_engine_matches_eager(engine, points + points[:1], torch.randn(4, 3, generator=gen), rtol=1e-5)


def _first_positive_potential(p):
    x = p["x"]
    mask = torch.zeros_like(x, dtype=torch.bool)  # depends on the shape only: a constant
    mask.scatter_(0, (x > 0).long().argmax(0, keepdim=True), True)  # written in place, each call
    return 0.5 * (x**2).sum() + torch.where(mask, x, torch.zeros_like(x)).sum()


def test_a_constant_written_in_place_is_fresh_at_every_call():
    """``zeros_like(x)`` depends on the shape only, but an in-place write fills it (as in
    ``cumprod``'s gradient, under a simplex site's stick-breaking transform). Folded into a
    constant, it was written into itself, so each call started from the previous call's
    writes; it is now made at every call: the same values as eager autograd, point after
    point."""
    flat = from_potential_fn(_first_positive_potential, {"x": torch.tensor([-1.0, 2.0, 3.0])})
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    points = [torch.tensor(p) for p in ([-1.0, 2.0, 3.0], [-1.0, -2.0, 3.0], [5.0, -2.0, -3.0], [-1.0, 2.0, 3.0])]
    for z in points:
        U, g = engine.value_and_grad(z)
        U0, g0 = flat.value_and_grad(z)
        torch.testing.assert_close((U, g), (U0, g0))


def test_ordered_logistic_regression_is_traced_and_matches_pyro():
    """Pyro's ``OrderedLogistic`` fills its probabilities in place; with ordered cutpoints
    (``ImproperUniform(ordered_vector)``, started at given values) the model is traced (it
    fell back to eager autograd) and agrees with Pyro's potential at random points."""
    from pyro.distributions import constraints
    from pyro.infer.autoguide import init_to_value

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, generator=gen)
    latent = 1.2 * x + torch.randn(200, generator=gen)
    y = (latent > -1).long() + (latent > 0.5).long()

    def ordered_logistic(x, y):
        b = pyro.sample("b", dist.Normal(0.0, 3.0))
        c = pyro.sample("c", dist.ImproperUniform(constraints.ordered_vector, (), (2,)))
        with pyro.plate("n", len(y)):
            pyro.sample("y", dist.OrderedLogistic(b * x, c), obs=y)

    init = init_to_value(values={"c": torch.tensor([-1.0, 1.0])})
    flat = from_model(ordered_logistic, (x, y), init_strategy=init, max_plate_nesting=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(flat)
    points = [flat.initial_z + torch.randn(3, generator=gen) for _ in range(3)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-4)


def test_a_fake_tensor_trace_refuses_to_promise_an_escape_check():
    """``fake=True`` (the compilers' trace) computes no values, so it cannot follow latent
    values into Python: asking for both is an error, not a silently skipped check."""
    with pytest.raises(ValueError, match="check_escapes=False"):
        tracing.trace(lambda x: (x**2).sum(), (torch.ones(2),), fake=True)


def _positive_sites(threshold):
    def model():
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(2.0))
        x = pyro.sample("x", dist.Normal(0.0, tau + sigma))
        if threshold is not None:  # a data-independent branch on the latent, as a tensor op
            pyro.factor("knee", torch.where(tau < threshold, -x**2, 0 * x))
    return model


def test_support_checks_of_positive_sites_are_removed_and_others_kept():
    """HalfCauchy masks ``value < 0`` and HalfNormal takes ``where(value >= 0, ...)``; on
    ``exp`` of the unconstrained value both are decided, so no comparison, mask or where
    is left, and the gradient equals Pyro's; a comparison that the sign of ``exp`` does not
    decide (``tau < 1``) stays. A NaN point still gives a non-finite energy."""
    checks = {torch.ops.aten.lt.Scalar, torch.ops.aten.ge.Scalar, torch.ops.aten.where.self,
              torch.ops.aten.masked_fill.Scalar, torch.ops.aten.masked_fill_.Scalar}
    for threshold, kept in ((None, False), (1.0, True)):
        flat = from_model(_positive_sites(threshold))
        engine = GradientEngine(flat)
        assert engine.name == "trace"
        targets = {n.target for n in engine._graph.graph.nodes if n.op == "call_function"}
        assert bool(targets & checks) == kept
        gen = torch.Generator().manual_seed(1)
        points = [2 * torch.randn(flat.dim, generator=gen) for _ in range(5)]
        _assert_engine_matches_eager(engine, points, rtol=1e-5, atol=1e-5)
        U, _ = engine.value_and_grad(torch.full((flat.dim,), float("nan")))
        assert not torch.isfinite(U)


@pytest.mark.parametrize("low, high", [(-1.0, 3.0), (0.0, 10.0), (1e-3, 1e4)])
def test_a_uniform_sites_support_check_is_decided_by_its_transform(low, high):
    """A ``Uniform(low, high)`` site reaches its distribution as ``low + (high - low) *
    clamp(sigmoid(z), tiny, 1 - eps)``, computed in float32 strictly inside ``[low, high)``, so
    its ``low <= value < high`` check (two comparisons, two casts, a product and a log in
    every gradient) is decided; the gradient equals Pyro's, also where the clamp is active
    (|z| = 30)."""
    flat = from_model(*_prior_of(dist.Uniform(low, high)))
    engine = GradientEngine(flat)
    targets = {n.target for n in engine._graph.graph.nodes if n.op == "call_function"}
    assert not targets & {torch.ops.aten.le.Tensor, torch.ops.aten.gt.Tensor, torch.ops.aten.log.default}
    points = [torch.tensor([v]) for v in (-30.0, -3.0, 0.0, 2.0, 30.0)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-5)


_CUMPROD_ZERO_GUARD = {torch.ops.aten.eq.Scalar, torch.ops.aten.scatter.value, torch.ops.aten.scatter_.value,
                       torch.ops.aten.max.dim, torch.ops.aten.gather.default}


@pytest.mark.parametrize("prior, most_ops", [(dist.Dirichlet(torch.ones(4)), (50, 65)),
                                              (dist.LKJCholesky(3, 2.0), (75, 90))])
def test_the_zero_guard_of_cumprods_gradient_is_decided_by_the_transforms_clamps(prior, most_ops):
    """Pyro's simplex and correlation transforms take a ``cumprod`` of factors they clamp
    away from 0 (``1 - clamp(sigmoid(x), tiny, 1 - eps)``, ``sqrt(1 - clamp(tanh(x), ...) **
    2)``), whose gradient guards against zero factors with ~25 operations of masks, scans
    and scatters (76 and 101 operations in all before). The factors' ranges decide the
    guard: none of its operations is left, and the gradient equals Pyro's, also where the
    clamps are active (|z| = 20: the factors at their smallest). What is left of the
    gradient without zeros differs between torch releases: 2.13 writes it as a reversed
    cumulative sum (48 and 71 operations in all), 2.9 as products of slices (64 and 87)."""
    flat = from_model(*_prior_of(prior))
    engine = GradientEngine(flat)
    targets = [n.target for n in engine._graph.graph.nodes if n.op == "call_function"]
    assert not set(targets) & _CUMPROD_ZERO_GUARD
    assert engine.gradient_ops <= most_ops[0 if torch.__version__ >= (2, 13) else 1]  # TorchVersion: compared as a version
    gen = torch.Generator().manual_seed(2)
    points = [2 * torch.randn(flat.dim, generator=gen) for _ in range(4)]
    points += [torch.full((flat.dim,), 20.0), torch.full((flat.dim,), -20.0)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("clamp_max, decided", [(None, False), (1 - 2**-24, True), (1 - 1e-9, False)])
def test_a_comparison_is_folded_only_where_the_values_range_decides_it(clamp_max, decided):
    """``sigmoid(x)`` reaches 0 and 1 in float32 (``x = -200``, ``x = 20``), so ``1 -
    sigmoid(x) == 0`` and ``log(1 - sigmoid(x)) == -inf`` stay comparisons; clamped below ``1 -
    2**-24`` (a float32 number), ``1 - s`` is at least ``2**-24``, and both are the constant
    false; clamped below ``1 - 1e-9``, which is 1 in float32, they stay. Each graph gives
    eager torch's values."""

    def fn(x):
        s = torch.sigmoid(x) if clamp_max is None else torch.clamp(torch.sigmoid(x), 0.0, clamp_max)
        y = 1 - s
        return torch.where(y == 0, torch.full_like(x, 7.0), y), (x < 0) == (y.sqrt() > 0.5), y.log() == -math.inf

    x = torch.tensor([-200.0, -1.0, 0.0, 3.0, 20.0, 100.0])
    gm = tracing.trace(fn, (x,), check_escapes=False)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert (torch.ops.aten.eq.Scalar not in targets) == decided
    assert torch.ops.aten.gt.Scalar in targets  # sqrt(1 - s) > 0.5 is not decided
    for a, b in zip(gm(x), fn(x)):
        assert torch.equal(a, b)


_RANGE_UNARY = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "sqrt": torch.sqrt, "log": torch.log,
                "square": lambda t: t ** 2, "one_minus": lambda t: 1 - t, "clamp01": lambda t: t.clamp(1e-30, 1 - 2**-23),
                "clamp": lambda t: t.clamp(-3.0, 7.5), "scale": lambda t: t * 2.5, "shift": lambda t: t + (-1.25)}
_RANGE_BINARY = {"add": torch.add, "mul": torch.mul, "addcmul": lambda a, b: torch.addcmul(a, a, b),
                 "affine": lambda a, b: torch.addcmul(torch.full_like(a, -1.0), a, torch.full_like(a, 4.0))}


def test_value_ranges_hold_every_value_of_random_compositions():
    """Soundness of the ranges the comparisons are folded by: 100 random chains of the ops
    ``_value_ranges`` follows (a unary op at each step, then maybe a binary one with an
    earlier value), in float32 and float64, evaluated at 4,010 points from -1e30 to 1e30,
    where the clamps, ``exp`` and ``sigmoid`` saturate and the roundings are at their
    bounds: every value of every node with a range lies in it (NaN aside). A range one
    unit too narrow (``sigmoid`` below 0.999) fails here."""
    checked = 0
    for seed in range(100):
        rng = random.Random(seed)
        steps = [(rng.choice(list(_RANGE_UNARY)), rng.choice(list(_RANGE_BINARY)) if rng.random() < 0.4 else None,
                  rng.randrange(100)) for _ in range(rng.randint(2, 8))]

        def fn(x):
            values = [x]
            for unary, binary, k in steps:
                v = _RANGE_UNARY[unary](values[-1])
                values.append(v if binary is None else _RANGE_BINARY[binary](v, values[k % len(values)]))
            return tuple(values[1:])

        for dtype in (torch.float32, torch.float64):
            gm = tracing._record(fn, (torch.linspace(-3, 3, 5, dtype=dtype),))
            ranges = tracing._value_ranges(gm)
            points = torch.cat([torch.linspace(-120, 120, 4001, dtype=dtype),
                                torch.tensor([-1e30, -88.8, -20, -9.01, 0.0, 9.01, 20, 88.8, 1e30], dtype=dtype)])
            interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
            interpreter.run(points)
            for node, (lo, hi) in ranges.items():
                values = interpreter.env[node].double()
                values = values[~values.isnan()]
                assert not values.numel() or lo <= values.min() and values.max() <= hi, (steps, node, lo, hi)
                checked += 1
    assert checked > 500


def test_in_place_writes_into_a_tensor_of_its_own_are_written_out_of_place():
    """``torch.zeros(n).scatter_(...)`` and ``m.logical_and_(...)`` into tensors nothing else
    reads after the write are their out-of-place forms, which the other passes may fold; a
    write that a view of the tensor sees stays in place. The same values."""

    def fn(x):
        mask = (x > 0).logical_and_(x < 2)  # a tensor of its own
        picked = torch.zeros(4).scatter_(0, torch.tensor([1, 3]), 1.0)  # constant inputs
        kept = x * 2
        view = kept[:2]
        kept.add_(1.0)  # the view sees it
        return torch.where(mask, x, picked), view

    x = torch.tensor([-1.0, 0.5, 1.5, 3.0])
    gm = tracing.trace(fn, (x,), check_escapes=False)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.logical_and_.default not in targets and torch.ops.aten.scatter_.value not in targets
    assert torch.ops.aten.scatter.value not in targets  # folded: a constant
    assert torch.ops.aten.add_.Tensor in targets
    for point in (x, torch.tensor([2.5, -0.5, 1.0, 0.1])):
        for a, b in zip(gm(point), fn(point)):
            assert torch.equal(a, b)


def test_the_batched_gradient_is_recorded_inside_a_compilers_fake_tensor_trace():
    """The compilers (``engine="aot"``/``"inductor"``) trace a many-chain program on fake
    tensors, and the batched gradient graph is first asked for in the middle of that trace.
    It must be recorded there on real tensors (its constant folding needs values), not given
    up for the loop over points, which also made the compiled many-chain program fail to
    trace and fall back to a slower traced one."""
    flat = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    engine = GradientEngine(flat, "inductor")
    batch = flat.initial_z + torch.randn(3, flat.dim, generator=torch.Generator().manual_seed(0))
    program = tracing.trace(lambda z: engine.value_and_grad(z), (batch,), check_escapes=False, fake=True)
    assert engine._batched_graphs[3] is not None
    U, g = program(batch)
    U_ref, g_ref = flat.batched_value_and_grad(batch)
    assert torch.allclose(U, U_ref, rtol=1e-5) and torch.allclose(g, g_ref, rtol=1e-5, atol=1e-6)


def _correlated_simplex():
    pyro.sample("w", dist.Dirichlet(torch.ones(4)))
    pyro.sample("corr", dist.LKJCholesky(3, 2.0))


def _gaussian_process(sparse=False):
    """Pyro's ``GPRegression`` (or ``SparseGPRegression`` with 4 inducing points) with priors
    on its hyperparameters, as in Pyro's GP tutorial: it adds the noise to the covariance's
    diagonal in place (``Kff.view(-1)[::N + 1] +=``)."""
    import pyro.contrib.gp as gp

    x = torch.linspace(0.0, 5.0, 12)
    kernel = gp.kernels.RBF(input_dim=1)
    kernel.variance = pyro.nn.PyroSample(dist.LogNormal(0.0, 1.0))
    kernel.lengthscale = pyro.nn.PyroSample(dist.LogNormal(0.0, 1.0))
    if sparse:
        regression = gp.models.SparseGPRegression(x, torch.sin(x), kernel, Xu=torch.linspace(0.0, 5.0, 4))
    else:
        regression = gp.models.GPRegression(x, torch.sin(x), kernel)
    regression.noise = pyro.nn.PyroSample(dist.LogNormal(-2.0, 1.0))
    return regression.model


def _ordinal_regression():
    """Pyro's ``OrderedLogistic`` with latent ordered cutpoints: its probabilities are
    written into columns of a zero matrix, ``p[..., 1:-1] = q[..., 1:] - q[..., :-1]``."""
    x = torch.linspace(-2.0, 2.0, 20)
    y = torch.arange(20) % 4

    def model():
        beta = pyro.sample("beta", dist.Normal(0.0, 5.0))
        prior = dist.Normal(0.0, 3.0).expand([3]).to_event(1)
        cutpoints = pyro.sample("c", dist.TransformedDistribution(prior, [dist.transforms.OrderedTransform()]))
        with pyro.plate("data", 20):
            pyro.sample("y", dist.OrderedLogistic(beta * x, cutpoints), obs=y)

    return model


def _writes_into_slices():
    """A matrix built by writes into its slices, of constants and of latent values."""

    def model():
        a = pyro.sample("a", dist.Normal(0.0, 1.0).expand([6]).to_event(1))
        B = a.reshape(2, 3).clone()
        B[:, -1] = 0.0
        B[..., :-1] *= 2.0
        C = torch.zeros(2, 3)
        C[:, -1] = a[0]
        C[0] = a[1:4]
        C[:, 0] += a[4]
        pyro.factor("f", -(B**2).sum() - (C**2).sum() - (a**2).sum())

    return model


def _censored_normal():
    """Observations censored above 1.0, their likelihood written with ``log_ndtr``."""
    y = torch.tensor([-0.3, 0.4, 1.0, 0.8, 1.0, -1.2])
    censored = y >= 1.0

    def model():
        loc = pyro.sample("loc", dist.Normal(0.0, 2.0))
        scale = pyro.sample("scale", dist.HalfNormal(1.0))
        above = torch.special.log_ndtr((loc - y) / scale)  # log P(Y > y)
        pyro.factor("y", torch.where(censored, above, dist.Normal(loc, scale).log_prob(y)).sum())

    return model


@pytest.mark.parametrize("name", ["simplex_and_LKJCholesky", "GPRegression", "SparseGPRegression", "OrderedLogistic",
                                  "writes_into_slices", "log_ndtr"])
def test_the_batched_gradient_of_writes_has_batching_rules(name):
    """Gradients that write in place, which ``vmap`` had no batching rules for:

    - of the stick-breaking transform (simplex sites) and of ``LKJCholesky`` (``scatter_``):
      it ran them one point at a time, printing torch's "performance drop" warning on every
      many-chain run; the single-point graph is functionalized before ``vmap``.
    - of a write into a strided slice (a Gaussian process's jitter on the covariance
      diagonal): through ``as_strided`` (``[n], [n + 1]``, or ``[1, n], [n * n, n + 1]`` in
      the sparse one) and ``copy_``. Under ``functionalize``, ``vmap`` failed on the slice "to
      the end" ("invalid size, possible overflow?") and had no rule for
      ``as_strided_scatter`` or ``copy``: the chains' gradients went through the one-point
      graph one by one (``tracing.for_vmap``).
    - of writes into a block of columns (``OrderedLogistic``): through ``as_strided``
      (``[n, 2], [4, 1]``), and under ``functionalize`` a ``slice_scatter`` with a negative
      end, which ``vmap`` failed on ("upper bound and lower bound inconsistent with step
      sign"): 4 chains took 8.6 s where they now take 3.4 s.
    - of writes into slices in a model (``B[:, -1] = 0.0``: ``fill_`` with a tensor, which
      ``vmap`` ran point by point; ``B[..., :-1] *= 2``: in the gradient an ``as_strided``
      block of a flat buffer, ``[2, 2], [3, 1]``, which it failed on).
    - ``torch.special.log_ndtr`` (no batching rule: point by point), written as torch's
      formula for it.

    Checked with ``vmap`` 's per-point fallback switched off, against Pyro's gradient,
    point by point."""
    model = {"simplex_and_LKJCholesky": lambda: _correlated_simplex, "GPRegression": _gaussian_process,
             "SparseGPRegression": lambda: _gaussian_process(sparse=True), "OrderedLogistic": _ordinal_regression,
             "writes_into_slices": _writes_into_slices, "log_ndtr": _censored_normal}[name]()
    flat = from_model(model)
    engine = GradientEngine(flat)
    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        assert engine._batched_graph(4) is not None
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(fallback)
    batch = flat.initial_z + 0.5 * torch.randn(4, flat.dim, generator=torch.Generator().manual_seed(0))
    U, g = engine.value_and_grad(batch)
    U_ref, g_ref = flat.batched_value_and_grad(batch)
    assert torch.allclose(U, U_ref, rtol=1e-5) and torch.allclose(g, g_ref, rtol=1e-4, atol=1e-5)


def test_as_strided_views_rewritten_as_slices_keep_their_values():
    """``for_vmap`` writes an ``as_strided`` view of a contiguous tensor as ``view`` +
    ``slice`` where it is one: a strided run (also with its offset as a keyword, and with
    dimensions of one element), a contiguous block, or a block of the shape its strides lay
    out; other layouts (a transpose, a block beyond the tensor's edge) stay ``as_strided``."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    views = [
        graph.call_function(aten.as_strided.default, (x, [3], [4]), {"storage_offset": 1}),  # a column
        graph.call_function(aten.as_strided.default, (x, [1, 4], [16, 5])),  # the diagonal as a row
        graph.call_function(aten.as_strided.default, (x, [2, 4], [4, 1], 8)),  # the last two rows
        graph.call_function(aten.as_strided.default, (x, [2, 2], [4, 1], 5)),  # a 2 x 2 block
        graph.call_function(aten.as_strided.default, (x, [4, 2], [4, 1], 1)),  # columns 1-2
        graph.call_function(aten.as_strided.default, (x, [2, 1, 3], [4, 7, 1], 9)),  # rows 2-3, columns 1-3
        graph.call_function(aten.as_strided.default, (x, [2, 2], [8, 2], 1)),  # rows 0 and 2, columns 1 and 3
        graph.call_function(aten.as_strided.default, (x, [4, 4], [1, 4])),  # the transpose: kept
        graph.call_function(aten.as_strided.default, (x, [2, 2], [4, 1], 3)),  # wraps past the last column: kept
    ]
    graph.output(tuple(views))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    example = torch.arange(16.0).reshape(4, 4)
    rewritten = tracing.for_vmap(gm, example)
    assert sum(n.target is aten.as_strided.default for n in rewritten.graph.nodes) == 2
    for expected, actual in zip(gm(example), rewritten(example)):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.float64, 2e-15)])
def test_log_ndtr_written_for_vmap_keeps_torchs_values(dtype, rtol):
    """``for_vmap`` writes ``special_log_ndtr`` as torch's own formula for it (``erfcx`` below
    -1, ``log1p(-erfc / 2)`` above): the same values to a few units in the last place, from
    the far tail (-40) to 10 and on both sides of the switch, all finite."""
    x = torch.cat([torch.linspace(-40.0, 10.0, 20001, dtype=dtype), torch.tensor([-1.0, -1.0 - 1e-6, -1.0 + 1e-6], dtype=dtype)])
    graph = torch.fx.Graph()
    graph.output((graph.call_function(torch.ops.aten.special_log_ndtr.default, (graph.placeholder("x"),)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    rewritten = tracing.for_vmap(gm, x)
    assert torch.ops.aten.special_log_ndtr.default not in [n.target for n in rewritten.graph.nodes]
    expected, actual = gm(x)[0], rewritten(x)[0]
    assert torch.isfinite(actual).all() and torch.allclose(actual, expected, rtol=rtol, atol=0.0)


def test_as_strided_views_of_random_layouts_rewritten_as_slices_keep_their_values():
    """``as_strided`` of random sizes, strides (``x`` 's own, or any) and offsets inside a
    contiguous tensor of up to three dimensions: wherever ``for_vmap`` rewrites the view as
    slices, it has the same shape and elements (305 of the 800 are rewritten)."""
    aten = torch.ops.aten
    rng = random.Random(0)
    rewritten = 0
    for _ in range(800):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
        example = torch.arange(float(math.prod(shape))).reshape(shape)
        size = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        stride = [rng.choice(list(example.stride()) + [rng.randint(0, 6)]) for _ in size]
        span = sum((n - 1) * k for n, k in zip(size, stride))
        if span >= example.numel():
            continue
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        view = graph.call_function(aten.as_strided.default, (x, size, stride, rng.randint(0, example.numel() - 1 - span)))
        graph.output((graph.call_function(aten.mul.Tensor, (view, 2.0)),))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        slices = tracing.for_vmap(gm, example)
        if any(n.target is aten.as_strided.default for n in slices.graph.nodes):
            continue
        rewritten += 1
        expected, actual = gm(example)[0], slices(example)[0]
        assert expected.shape == actual.shape and torch.equal(expected, actual), (shape, size, stride)
    assert rewritten > 250


def test_vectorized_chains_of_a_gaussian_process_run_their_recorded_programs():
    """4 chains' full-length trajectories from their first states took the Gaussian
    process's Cholesky beyond its support at every point where the round program was to be
    recorded, and the whole run silently went op by op on eager autograd (57 s against the
    sequential chains' 6 s). The program is now also recorded at the chains' states with
    tiny steps; and a program that cannot be recorded anywhere says so."""
    pyro.set_rng_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        mcmc = pyro_hmc_plus.MCMC(NUTS(_gaussian_process()), num_samples=20, warmup_steps=20, num_chains=4,
                                  disable_progbar=True, warn_on_problems=False)
        mcmc.run()
    assert mcmc.get_samples(group_by_chain=True)["noise"].shape == (4, 20)


def _plate_regression(x, y):
    def model():
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(2.0))
        with pyro.plate("data", len(y)):
            pyro.sample("y", dist.Normal(mu + x, sigma), obs=y)
    return model


def test_scalars_broadcast_by_a_plate_are_computed_before_broadcasting():
    """``Normal(loc, sigma)`` over a plate of 500 takes ``log``/``pow`` of ``sigma`` expanded
    to 500 elements, its gradient divides by it again, and the gradient's folded constants
    are 500 copies of one number: after tracing, no ``expand`` is left, ``log`` and ``pow``
    of the scale run on one element, and values (one point and a batch) equal Pyro's."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(500, generator=gen), torch.randn(500, generator=gen)
    flat = from_model(_plate_regression(x, y))
    engine = GradientEngine(flat)
    assert engine.name == "trace"
    nodes = [n for n in engine._graph.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.expand.default not in {n.target for n in nodes}
    sigma_ops = [n for n in nodes if n.target in (torch.ops.aten.log.default, torch.ops.aten.pow.Tensor_Scalar)
                 and n.args[0].target is torch.ops.aten.exp.default]
    assert sigma_ops, "the scale's log and square are still in the graph"
    assert all(getattr(engine._graph, n.target).numel() == 1
               for n in engine._graph.graph.nodes if n.op == "get_attr" and n.target.startswith("_uniform_"))
    points = [torch.randn(flat.dim, generator=gen) for _ in range(4)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-4)


def test_a_mixtures_weights_broadcast_by_a_plate_are_normalised_once():
    """``MixtureSameFamily`` over a plate normalises its weights (``log_softmax`` along the
    components) after the plate broadcast them to every observation: the gradient normalises
    them once (5,000 x 3: ~200 µs -> ~2), and its gradient is written as a formula of the
    unbroadcast weights (~90 -> ~40 µs), with the values of Pyro's; a normalisation along a
    dimension that an ``expand`` broadcasts is left as it is."""

    def mixture(x):
        w = pyro.sample("w", dist.Dirichlet(torch.ones(3)))
        loc = pyro.sample("loc", dist.Normal(0.0, 5.0).expand([3]).to_event(1))
        with pyro.plate("n", len(x)):
            pyro.sample("x", dist.MixtureSameFamily(dist.Categorical(w), dist.Normal(loc, 1.0)), obs=x)

    gen = torch.Generator().manual_seed(0)
    flat = from_model(mixture, (3 * torch.randn(500, generator=gen),))
    engine = GradientEngine(flat)
    from torch.fx.passes.shape_prop import ShapeProp

    ShapeProp(engine._graph).propagate(flat.initial_z)
    normalised = [n for n in engine._graph.graph.nodes if n.target is torch.ops.aten._log_softmax.default]
    assert normalised and all(tuple(n.meta["tensor_meta"].shape) == (3,) for n in normalised)
    targets = {n.target for n in engine._graph.graph.nodes}
    assert torch.ops.aten._log_softmax_backward_data.default not in targets  # its formula, on the weights
    points = [0.5 * torch.randn(flat.dim, generator=gen) for _ in range(4)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-4)

    def fn(z):  # broadcast along the normalised dimension: log_softmax of 3 equal numbers
        return torch.log_softmax(z[:1].expand(2, 3), -1), torch.log_softmax(z.expand(2, 3), -1)

    z = torch.tensor([0.5, -1.0, 2.0])
    gm = tracing.trace(fn, (z,), check_escapes=False)
    for ours, eager in zip(gm(z), fn(z)):
        assert torch.allclose(ours, eager)


_LOG_SOFTMAX_KERNELS = {torch.ops.aten._log_softmax.default, torch.ops.aten._log_softmax_backward_data.default}


@pytest.mark.parametrize("classes, observations, formulas", [(3, 600, True), (8, 600, False), (3, 100, False)])
def test_log_softmax_along_short_rows_is_written_as_formulas(classes, observations, formulas):
    """``log_softmax`` along rows of a few elements, where torch's CPU kernels run a scalar
    loop per row (5,000 x 3: ~180 µs, its gradient ~90): the gradient computes ``x -
    logsumexp(x)`` and ``g - exp(o) * g.sum(-1)`` instead, with the values of Pyro's. Rows of
    8 or more, and fewer than 512 rows, keep the kernels."""

    def softmax_regression(x, y):
        weights = pyro.sample("weights", dist.Normal(0.0, 1.0).expand([x.shape[1], classes]).to_event(2))
        log_probs = torch.log_softmax(x @ weights, -1)
        pyro.factor("y", log_probs.gather(-1, y.unsqueeze(-1)).sum())

    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(observations, 2, generator=gen), torch.randint(classes, (observations,), generator=gen))
    flat = from_model(softmax_regression, data)
    engine = GradientEngine(flat)
    assert _LOG_SOFTMAX_KERNELS.isdisjoint(n.target for n in engine._graph.graph.nodes) == formulas
    points = [flat.initial_z + torch.randn(flat.dim, generator=gen) for _ in range(4)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("observations", [100, 600])
def test_a_log_softmax_of_normalised_logits_is_the_logits(observations):
    """``MixtureSameFamily(Categorical(logits=a), ...)`` normalises its weights twice:
    ``Categorical`` stores ``a - logsumexp(a)``, and the mixture takes ``log_softmax`` of
    that. The gradient takes the normalised logits as they are, and the ``log_softmax``'s
    gradient drops out (the normalisation's own gradient removes what it would add): no
    ``log_softmax`` is left, whatever the rows' number and length, and the values are
    Pyro's. (A mixture of regressions, 3 components, 5,000 observations: 420 -> 296 µs a
    gradient.)"""

    def mixture_of_regressions(x, y):
        weights = pyro.sample("weights", dist.Normal(0.0, 1.0).expand([x.shape[1], 3]).to_event(2))
        loc = pyro.sample("loc", dist.Normal(0.0, 5.0).expand([3]).to_event(1))
        with pyro.plate("n", len(y)):
            mixing = dist.Categorical(logits=x @ weights)
            pyro.sample("y", dist.MixtureSameFamily(mixing, dist.Normal(loc, 1.0)), obs=y)

    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(observations, 2, generator=gen), 3 * torch.randn(observations, generator=gen))
    flat = from_model(mixture_of_regressions, data)
    engine = GradientEngine(flat)
    assert _LOG_SOFTMAX_KERNELS.isdisjoint(n.target for n in engine._graph.graph.nodes)
    points = [flat.initial_z + torch.randn(flat.dim, generator=gen) for _ in range(4)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-4)


def test_a_broadcast_whose_result_type_depends_on_its_shape_is_kept():
    """A 0-d float64 tensor broadcast to a vector and multiplied with a float32 vector gives
    float64; unbroadcast, type promotion would give float32: that op keeps its ``expand``."""
    def fn(z):
        scale = z.sum().double().expand(3)
        return (scale * z, (z.exp().expand(2, 3) * 2.0).sum(0))

    z = torch.tensor([0.5, -1.0, 2.0])
    gm = tracing.trace(fn, (z,), check_escapes=False)
    out, summed = gm(z)
    assert out.dtype == torch.float64 and torch.equal(out, fn(z)[0])
    assert torch.allclose(summed, fn(z)[1])
    kept = [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default]
    assert len(kept) == 2  # the float64 broadcast, and the one the final sum needs


def _grouped_intercepts(group, y, shift: int):
    def model():
        a = pyro.sample("a", dist.Normal(torch.zeros(4), 1.0).to_event(1))
        pyro.sample("y", dist.Normal(a[group - shift], 1.0).to_event(1), obs=y)
    return model


def test_gathering_by_a_constant_group_index_uses_index_select_and_index_add():
    """``a[group]`` and its gradient (an accumulating ``index_put``) become ``index_select``
    and ``index_add``, single point and batch, with Pyro's values; an index with negative
    entries (counted from the end, which ``index_select`` refuses) keeps ``a[group]``."""
    gen = torch.Generator().manual_seed(0)
    group = torch.arange(4).repeat_interleave(5)[torch.randperm(20, generator=gen)]
    y = torch.randn(20, generator=gen)
    aten = torch.ops.aten
    for shift, rewritten in ((0, True), (2, False)):
        flat = from_model(_grouped_intercepts(group, y, shift))
        engine = GradientEngine(flat)
        assert engine.name == "trace"
        targets = {n.target for n in engine._graph.graph.nodes if n.op == "call_function"}
        assert ({aten.index_select.default, aten.index_add.default} <= targets) == rewritten
        assert aten.new_zeros.default not in targets  # index_add's zeros: a constant, not an op per call
        assert bool(targets & {aten.index.Tensor, aten.index_put.default}) != rewritten
        points = [torch.randn(flat.dim, generator=gen) for _ in range(3)]
        _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-5)


def _ops_making(gm, z, numel: int) -> int:
    """How many operations of ``gm``, run at ``z``, make a tensor of ``numel`` elements."""
    from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

    ShapeProp(gm).propagate(z)
    return sum(n.op == "call_function" and isinstance(n.meta.get("tensor_meta"), TensorMetadata)
               and n.meta["tensor_meta"].shape.numel() == numel for n in gm.graph.nodes)


def test_numbers_are_taken_out_of_a_plates_sums_and_products(monkeypatch):
    """``Normal(mu + x, sigma)`` over a plate of 500 computes ``-(r ** 2) / (2 sigma ** 2) -
    log(sigma) - 0.919`` on 500 elements before summing; its gradient in ``sigma`` sums a
    chain of its own over the plate, and its gradient in ``mu`` scales ``r`` by three
    factors in turn. With the numbers taken out of the sums (``sum(r ** 2)`` once, the rest
    on one element) and the factors gathered, the plate's elements go through 3 ops
    instead of 14 (the residual's two, its square), the whole graph is smaller, ``log(exp(u))``
    of the scale is ``u``, and the values equal Pyro's, one point and a batch."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(500, generator=gen), torch.randn(500, generator=gen)
    flat = from_model(_plate_regression(x, y))
    engine = GradientEngine(flat)
    aten = torch.ops.aten
    logs = [n for n in engine._graph.graph.nodes if n.target is aten.log.default]
    assert not any(n.args[0].target is aten.exp.default for n in logs)
    monkeypatch.setattr(tracing, "pull_scalars_out_of_sums", lambda gm, recompile=True: gm)
    monkeypatch.setattr(tracing, "gather_scalar_factors", lambda gm, recompile=True: gm)
    plain = GradientEngine(flat)
    z = flat.initial_z
    assert _ops_making(engine._graph, z, 500) == 3 < _ops_making(plain._graph, z, 500)
    assert engine.gradient_ops < plain.gradient_ops
    points = [torch.randn(flat.dim, generator=gen) for _ in range(4)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-4)


def test_a_plates_shared_probability_is_not_computed_per_observation():
    """``Binomial(10, probs=p)`` over a plate of 300 expands ``p`` to 300 and takes its
    clamp, logit and ``log1p`` there; the gradient of torch's ``clamp`` writes one mask in
    place, which once kept every result of the graph full-size. Now only written results
    stay full: 12 ops make 300-element tensors instead of 40 (on 100,000 observations the
    gradient ran ~4x faster), with Pyro's values, one point and a batch."""
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(0, 11, (300,), generator=gen).float()

    def model():
        p = pyro.sample("p", dist.Beta(1.0, 1.0))
        with pyro.plate("d", 300):
            pyro.sample("y", dist.Binomial(10.0, p), obs=y)

    flat = from_model(model)
    engine = GradientEngine(flat)
    assert _ops_making(engine._graph, flat.initial_z, 300) <= 12
    points = [torch.randn(flat.dim, generator=gen) for _ in range(4)]
    _assert_engine_matches_eager(engine, points, torch.stack(points), rtol=1e-5, atol=1e-4)


def _read_across_a_write_linear(x):  # b + 3 composed into a * 2 + 3 would read a after its write
    a = x.clone()
    b = a * 2.0
    a.add_(1.0)
    return b + 3.0, a


def _read_across_a_write_through_a_view(x):  # the two a * 2.0 look alike; a[0] = 7 is between them
    a = x.clone()
    before = a * 2.0
    a[0] = 7.0
    return before, a * 2.0


def _read_across_a_write_in_a_loop(x):  # six alike reads before the write, six after
    a = x.clone()
    before = [(a[i] * 3.0).exp() for i in range(6)]
    a[1:3] = 0.0
    return torch.stack(before), torch.stack([(a[i] * 3.0).exp() for i in range(6)])


def _read_across_a_write_scaled_sum(x):  # a * s before the write and after it
    a, s = x.clone(), x[5]
    b = a * s
    a[0] = s * 5
    return (b * s).sum() - (a * s).sum(), (a / s).sum() + (-b).sum()


def _copy_before_a_write(x):  # a * 1.0, a + 0, cat([a]): copies of a's values before the write
    a = x.clone()
    copies = (a * 1.0, a + 0, torch.cat([a]))
    a.add_(1.0)
    return tuple(c.exp() for c in copies) + (a,)


@pytest.mark.parametrize("fn", [_read_across_a_write_linear, _read_across_a_write_through_a_view,
                                _read_across_a_write_in_a_loop, _read_across_a_write_scaled_sum,
                                _copy_before_a_write])
def test_reads_before_and_after_an_in_place_write_keep_their_values(fn):
    """The recorded graph reads a tensor by its node before an in-place write into it (or
    into a view of it) and after it alike; so two such reads that look the same are not
    merged, a chain of linear ops is not composed across the write, ops reading it are not
    vectorized or taken apart, and a copy of it (``a * 1.0``) is not replaced by it (each of
    these gave the written values to reads made before the write)."""
    gm = tracing.trace(fn, (torch.randn(6),), check_escapes=False)
    for _ in range(3):
        x = torch.randn(6)
        for actual, expected in zip(gm(x.clone()), fn(x.clone())):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graph_pass", ["pull_scalars_out_of_sums", "gather_scalar_factors"])
def test_taking_numbers_out_never_reads_a_tensor_after_it_is_written(graph_pass):
    """``sum(x * s)`` becomes ``sum(x) * s`` and ``x * 3 * s * t`` one op on ``x``, both
    computed where the sum or the last product was. If ``x`` is written in place in between,
    those ops would read the written values: each pass, run alone on the recorded graph,
    leaves such ops as they are, and takes apart the others."""
    def fn(x, s, t):
        written = x * t
        product = written * s
        scaled = written * 3.0
        written.add_(1.0)
        late = product.sum()  # the sum of what was read before the write
        gathered = scaled * s * t  # the same
        base = x * 1.5
        part = base[1:]
        in_part = part * s
        part_scaled = part * 2.0
        base[1] = 5.0  # written through another view of part's base
        late_part = in_part.sum() + (part_scaled * s).sum()
        free = (x * s).sum() + (x * 2.0 * s * t).sum()  # x is never written: taken apart
        return late, gathered, late_part, free, written, base

    x, s, t = torch.randn(50), torch.tensor(0.7), torch.tensor(-1.3)
    gm = tracing._record(fn, (x, s, t))
    before = gm.code
    getattr(tracing, graph_pass)(gm)
    assert gm.code != before  # `free` was taken apart
    for _ in range(3):
        x, s, t = torch.randn(50), torch.randn(()), torch.randn(())
        for actual, expected in zip(gm(x, s, t), fn(x, s, t)):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_broadcast_result_updated_in_place_stays_a_full_tensor():
    """An in-place update of an op's result cannot write into an ``expand`` (one element
    seen many times): in a graph with in-place updates, results keep their shape."""
    def fn(z):
        t = z.sum().exp().expand(3) * 2.0
        t.add_(z)
        return (t * 3.0).sum(), t

    z = torch.tensor([0.5, -1.0, 2.0])
    gm = tracing.trace(fn, (z,), check_escapes=False)
    for actual, expected in zip(gm(z), fn(z)):
        assert torch.allclose(actual, expected)


def test_values_a_program_does_not_read_are_not_computed():
    """A recorded function called inside a recording hands its results on as one tuple,
    which kept every one of them alive: a fused HMC transition computed the energy at each
    of its leapfrog steps although it reads only the last. The program takes such tuples
    apart, drops what nothing reads, and returns what it returned before (a tensor, or a
    tuple of tensors), with the same values."""
    energy_and_gradient = tracing.to_torchscript(lambda z: ((z.exp() + z.sin()).sum(), z * 2), (torch.randn(3),))

    def gradients_only(z):
        return energy_and_gradient(z)[1] + energy_and_gradient(3 * z)[1]

    def last_energy(z):
        _, g = energy_and_gradient(z)
        return (energy_and_gradient(z - g)[0],)

    z = torch.tensor([0.5, -1.0, 2.0])
    gradients_program = tracing.to_torchscript(gradients_only, (z,))
    energy_program = tracing.to_torchscript(last_energy, (z,))
    kinds = [node.kind() for node in gradients_program.graph.nodes()]
    assert not {"aten::exp", "aten::sin", "aten::sum", "prim::TupleConstruct", "prim::TupleUnpack"} & set(kinds)
    assert [node.kind() for node in energy_program.graph.nodes()].count("aten::exp") == 1
    z2 = torch.tensor([0.1, 0.2, -0.3])
    assert torch.equal(gradients_program(z2), gradients_only(z2))
    (energy,) = energy_program(z2)
    assert torch.equal(energy, last_energy(z2)[0])


def test_recorded_programs_take_numbers_as_tensors_of_their_operands_dtype():
    """``x * 2``, ``u < 0.5``, ``n + 1``, ``0.3 - x``, ``x - 0.1``, ``x ** 2`` are recorded
    with a number (a Python scalar, or a 0-d tensor of another dtype); the program takes a
    0-d constant of the operand's dtype instead (``x * x`` for the square), with the same
    values and dtypes. An int tensor meeting a float keeps the number (the comparison is
    made in floating point)."""
    def fn(x, n):
        return x * 2, x > 0.5, n + 1, x ** 2, 0.3 - x, x - 0.1, n > 1.5, n / 2

    x, n = torch.tensor([0.1, -2.5, 3.0]), torch.tensor([1, 2, 3])
    program = tracing.to_torchscript(fn, (x, n))
    for actual, expected in zip(program(x, n), fn(x, n)):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    ops = [node for node in program.graph.nodes() if node.kind().startswith("aten::")]
    assert "aten::pow" not in {node.kind() for node in ops}
    numbers = [node.kind() for node in ops
               if any(v.node().kind() == "prim::Constant" and v.type().kind() in ("FloatType", "IntType")
                      or v.type().kind() == "TensorType" and v.node().kind() == "prim::Constant"
                      and v.type().scalarType() != node.inputsAt(0).type().scalarType()
                      for v in list(node.inputs())[1:2])]
    assert numbers == ["aten::gt"]  # n > 1.5 (n / 2 divides by a long tensor: n's own dtype)


def test_recorded_programs_take_the_ops_static_runtime_runs_into_planned_buffers():
    """Sums of numbers are recorded as ``sub`` with the negated ``alpha``, ``1 - x`` as
    ``sub`` with the operands swapped, and ``&``, ``|`` as ``bitwise_and``, ``bitwise_or``
    (Static Runtime runs these into its planned buffers, the others not), with the same
    values, signed zeros, infinities and NaNs, and dtypes, on the TorchScript program and
    on Static Runtime; a sum of booleans (a logical or, which ``sub`` refuses) stays an
    ``add``."""
    def fn(x, y, n, b):
        return (x + y, x + 2, torch.add(x, y, alpha=0.3), x - y, n + n, n + 1, torch.add(b, b), b & (x > 0),
                b | (y > 0), 1 - x, torch.rsub(x, y, alpha=0.3), 3 - n)

    x = torch.tensor([0.1, -0.0, float("inf"), float("nan"), -2.5, 1e30])
    y = torch.tensor([0.2, -0.0, float("-inf"), 1.0, 2.5, 1e30])
    n, b = torch.tensor([1, -2, 3, 4, 5, 6]), torch.tensor([True, False, True, False, True, False])
    program = tracing.to_torchscript(fn, (x, y, n, b))
    ops = [node.kind() for node in program.graph.nodes() if node.kind().startswith("aten::")]
    assert ops.count("aten::add") == 1 and ops.count("aten::sub") == 9 and "aten::rsub" not in ops
    assert {"aten::bitwise_and", "aten::bitwise_or"} <= set(ops) and not {"aten::__and__", "aten::__or__"} & set(ops)
    static = _compile.static_runtime(program, (x, y, n, b))
    for run in (program, static):
        for actual, expected in zip(run(x, y, n, b), fn(x, y, n, b)):
            assert actual.dtype == expected.dtype and torch.equal(actual.isnan(), expected.isnan())
            assert torch.equal(actual.nan_to_num(), expected.nan_to_num())
            if actual.is_floating_point():
                assert torch.equal(actual.signbit(), expected.signbit())


def test_recorded_programs_drop_conversions_that_return_their_input():
    """``n.to(torch.int64)`` of a long tensor and ``x.to(torch.float32)`` of a float one are
    the tensors themselves: their readers read them directly. A conversion to another dtype
    stays, and so does one the program returns."""
    def fn(x, n):
        return n.to(torch.int64) + 1, x.to(torch.float32) * 2, x.to(torch.float64), x.to(torch.float32), n.to(x)

    x, n = torch.tensor([0.5, -1.5, 3.0]), torch.tensor([1, 2, 3])
    program = tracing.to_torchscript(fn, (x, n))
    conversions = [node for node in program.graph.nodes() if node.kind() == "aten::to"]
    assert len(conversions) == 3  # to float64, the returned one, and n to x's dtype
    for actual, expected in zip(program(x, n), fn(x, n)):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)


def test_gradient_elements_measure_arithmetic_not_operations():
    """The engine's ``gradient_elements`` counts the tensor elements a gradient touches (a
    product with a 1000 x 20 design matrix, forward and backward, at least twice 20,000),
    where counting operations would rate the regression and a 2-D Gaussian alike."""
    x = torch.randn(1000, 20)

    def regression(params):
        return 0.5 * ((x @ params["w"]) ** 2).sum() + 0.5 * (params["w"] ** 2).sum()

    big = GradientEngine(from_potential_fn(regression, {"w": torch.zeros(20)}, None), "trace")
    small = GradientEngine(from_potential_fn(lambda p: 0.5 * (p["q"] ** 2).sum(), {"q": torch.zeros(2)}, None), "trace")
    assert big.gradient_elements >= 2 * x.numel() and small.gradient_elements < 100
    assert GradientEngine(small.flat, "eager").gradient_elements is None


BATCHED_BERNOULLI_SCRIPT = """
import sys, torch, pyro, pyro.distributions as dist
from pyro_hmc_plus import GradientEngine, from_model
torch.set_default_dtype(torch.float64)
g = torch.Generator().manual_seed(0)
x = torch.randn(300, 3, generator=g) * 20  # logits far beyond +-30 for some draws of w
y = torch.bernoulli(torch.full((300,), 0.5), generator=g)
def logistic(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(3), 1.0).to_event(1))
    with pyro.plate("n", 300):
        pyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)
def correlated_simplex():
    pyro.sample("w", dist.Dirichlet(torch.ones(4)))
    pyro.sample("corr", dist.LKJCholesky(3, 2.0))
import pyro.contrib.gp as gp
t = torch.linspace(0.0, 5.0, 12)
kernel = gp.kernels.RBF(input_dim=1)
kernel.lengthscale = pyro.nn.PyroSample(dist.LogNormal(0.0, 1.0))
regression = gp.models.GPRegression(t, torch.sin(t), kernel)
regression.noise = pyro.nn.PyroSample(dist.LogNormal(-2.0, 1.0))
for model, args, spread in ((logistic, (x, y), 3), (correlated_simplex, (), 3), (regression.model, (), 0.5)):
    flat = from_model(model, args)
    engine = GradientEngine(flat, "trace")
    z = flat.initial_z + torch.randn(4, flat.dim, generator=g) * spread
    U, grad = engine.value_and_grad(z)
    assert engine._batched_graphs[4] is not None
    for i in range(4):
        U_i, grad_i = engine.eager_value_and_grad(z[i])
        torch.testing.assert_close((U[i], grad[i]), (U_i, grad_i), rtol=1e-10, atol=1e-10)
print("torch._dynamo" in sys.modules)
"""


def test_batched_gradients_need_no_dynamo():
    """The gradient for a batch of chains is ``vmap`` of the one-point graph; ``vmap`` has no
    batching rule for ``binary_cross_entropy_with_logits`` (every ``Bernoulli(logits=...)``),
    nor, under ``functionalize``, for some in-place ops (``exp_``, ``clamp_``,
    ``bitwise_and_``: simplex and ``LKJCholesky`` sites), and would run their Python
    decompositions, whose first call imports ``torch._dynamo`` (~1.1 s of a run). The batched
    graph writes them in ops that batch: the values (at logits of several hundred) agree
    with Pyro's eager potential, and nothing imports dynamo (a fresh process: this one's
    tests may have). A Gaussian process's graph is functionalized by the package's own
    recorder before ``vmap`` (``make_fx`` imports ``torch._inductor`` and with it dynamo)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", BATCHED_BERNOULLI_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


_NOISE = torch.Generator().manual_seed(0)


def _data_drawn_in_the_model():
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(mu, 1.0), obs=torch.randn(5, generator=_NOISE))


def _dropout_in_training_mode():
    w = pyro.sample("w", dist.Normal(torch.zeros(4), 1.0).to_event(1))
    pyro.sample("y", dist.Normal(torch.nn.functional.dropout(w, 0.5, training=True).sum(), 1.0), obs=torch.tensor(1.0))


def _posterior_predictive_drawn_in_the_model():
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    pyro.deterministic("y_rep", dist.Normal(mu, 1.0).sample())
    pyro.sample("y", dist.Normal(mu, 1.0), obs=torch.tensor(1.0))


def test_a_random_draw_that_the_potential_does_not_use_keeps_the_traced_engine():
    """Pyro scores a ``pyro.deterministic`` site 0 whatever its value, so a posterior
    predictive draw inside the model leaves the potential one function of the latent values:
    the engine traces it without a word (it fell back to eager autograd, with a warning that
    the draws might be wrong), and the draws follow the exact posterior, ``mu | y = 1`` ~
    N(0.5, 1/2); the draw itself is still made at each replay of the model (ArviZ's export),
    from the predictive distribution N(mu, 1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        engine = GradientEngine(from_model(_posterior_predictive_drawn_in_the_model))
        assert engine.name == "trace"
        pyro.set_rng_seed(0)
        mcmc = pyro_hmc_plus.MCMC(NUTS(_posterior_predictive_drawn_in_the_model), 2000, 500, num_chains=2,
                                  disable_progbar=True, warn_on_problems=False)
        mcmc.run()
    mu = mcmc.get_samples()["mu"].numpy()
    assert_mean(mu, 0.5)
    assert_variance(mu, 0.5)
    posterior = mcmc.to_inference_data().posterior
    residual = (posterior["y_rep"] - posterior["mu"]).values.reshape(-1)
    assert_mean(residual, 0.0)
    assert_variance(residual, 1.0)


def _branch_on_a_random_number():
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    scale = 1.0 if torch.rand(()) < 0.5 else 3.0
    pyro.sample("y", dist.Normal(mu, scale), obs=torch.tensor(1.0))


@pytest.mark.parametrize("model, says", [(_data_drawn_in_the_model, "draws random numbers"),
                                         (_dropout_in_training_mode, "draws random numbers"),
                                         (_branch_on_a_random_number, r"`if`.* on random numbers it draws \(rand\)")])
def test_a_potential_that_draws_random_numbers_is_named_as_such(model, says):
    """A potential that draws random numbers has no one value at a point. The fallback
    warning says so and does not call eager autograd correct (it was a ``SyntaxError`` from
    the graph's generated code where the model passed a ``torch.Generator``, or a
    disagreement with Pyro's potential). So for a branch on a random number, whose draw
    itself reaches no output."""
    with pytest.warns(EngineFallbackWarning, match=says) as record:
        engine = GradientEngine(from_model(model))
    assert engine.name == "eager"
    message = str(record[0].message)
    assert "only if those random numbers leave its value unchanged" in message and "correct but slow" not in message
