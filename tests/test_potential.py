import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import MCMC
from pyro.infer.autoguide import init_to_mean, init_to_median, init_to_value
from pyro.infer.mcmc.util import initialize_model
from pyro.infer.reparam import ProjectedNormalReparam
from pyro.ops.integrator import potential_grad

from pyro_hmc_plus import HMC, NUTS, SiteLayout, from_model, from_potential_fn
from pyro_hmc_plus.potential import (
    check_initial_point,
    flat_coordinates,
    gradient_mismatch,
    sites_that_come_and_go,
    sites_with_moving_supports,
    trace_at,
)

from helpers import assert_mean
from models import (
    EIGHT_SCHOOLS_SIGMA,
    EIGHT_SCHOOLS_Y,
    dirichlet_categorical,
    eight_schools,
    site_only_where_positive,
    two_scales,
)


def test_layout_sorted_by_name_and_roundtrips():
    params = {"b": torch.randn(2, 3), "a": torch.randn(()), "c": torch.randn(4)}
    layout = SiteLayout.of(params)
    assert layout.names == ("a", "b", "c") and layout.dim == 11
    z = layout.pack(params)
    assert z.shape == (11,)
    back = layout.unpack(z)
    for k in params:
        assert torch.equal(back[k], params[k])
    batched = {k: torch.stack([v, v + 1]) for k, v in params.items()}
    zb = layout.pack(batched, batch_shape=(2,))
    assert zb.shape == (2, 11) and torch.allclose(zb[1] - zb[0], torch.ones(11))


def test_pack_rejects_wrong_shapes_and_missing_sites():
    layout = SiteLayout.of({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="site 'a' has shape"):
        layout.pack({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="missing latent sites"):
        layout.pack({})


def test_value_and_grad_matches_pyro_potential_grad():
    flat = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    init, potential_fn, _, _ = initialize_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    for _ in range(3):
        z = torch.randn(flat.dim)
        U, g = flat.value_and_grad(z)
        params = flat.layout.unpack(z.clone())
        grads, U_ref = potential_grad(potential_fn, params)
        assert torch.allclose(U, U_ref, rtol=1e-5)
        assert torch.allclose(g, flat.layout.pack(grads), rtol=1e-5, atol=1e-6)


def test_constrained_sites_use_pyro_transforms():
    flat = from_model(dirichlet_categorical, (torch.tensor([3.0, 5.0, 2.0]),))
    assert flat.dim == 2  # the simplex is unconstrained to R^2
    assert set(flat.transforms) == {"p"}


def test_potential_fn_requires_initial_params():
    with pytest.raises(ValueError, match="initial_params"):
        from_potential_fn(lambda p: (p["x"] ** 2).sum(), None)


def test_non_finite_initial_values_are_rejected():
    with pytest.raises(ValueError, match="not finite"):
        from_potential_fn(lambda p: (p["x"] ** 2).sum(), {"x": torch.tensor([0.0, float("nan")])})


def test_initial_point_with_a_non_finite_gradient_is_rejected_naming_its_sites():
    with pytest.raises(ValueError, match=r"gradient .* not finite for sites \['a'\] .* other initial values"):
        from_potential_fn(lambda p: p["a"].abs().sqrt().sum() + (p["b"] ** 2).sum(),
                          {"a": torch.zeros(2), "b": torch.zeros(1)})


def _scale_then_location():
    scale = pyro.sample("scale", dist.HalfNormal(1.0))
    pyro.sample("loc", dist.Normal(0.0, scale).expand([2]).to_event(1))
    pyro.sample("p", dist.Beta(2.0, 2.0))


@pytest.mark.parametrize("values, site, shown", [
    ({"scale": torch.tensor(-1.0)}, "scale", r"\[-1.0\]"),
    ({"scale": torch.tensor(float("nan"))}, "scale", r"\[nan\]"),
    ({"loc": torch.tensor([0.0, float("inf")])}, "loc", r"\[0.0, inf\]"),
    ({"p": torch.tensor(1.5)}, "p", r"\[1.5\]"),
])
def test_initial_values_outside_their_supports_name_the_site(values, site, shown):
    """``init_to_value`` with a value outside its site's support, or not finite, fails as it is
    given, naming the site and its support; a negative scale used to fail one line later as
    torch's "normal expects all elements of std >= 0.0", without a name (Pyro's kernels too)."""
    with pytest.raises(ValueError, match=rf"latent site '{site}' initial values outside its support or not finite "
                                         rf".*: {shown}"):
        from_model(_scale_then_location, init_strategy=init_to_value(values=values))
    flat = from_model(_scale_then_location, init_strategy=init_to_value(values={"scale": torch.tensor(2.0)}))
    unconstrained_scale = flat.layout.unpack(flat.initial_z)["scale"]
    assert flat.transforms["scale"].inv(unconstrained_scale).item() == pytest.approx(2.0, rel=1e-6)


def test_init_to_mean_of_a_prior_without_a_finite_mean_names_the_site_and_init_to_median():
    """Pyro's ``init_to_mean`` gives ``inf`` for a ``HalfCauchy`` scale (eight schools' prior),
    and Pyro's kernels then stop with "cannot find valid initial params"; the error names the
    site and the strategy to use instead."""
    def model():
        pyro.sample("tau", dist.HalfCauchy(5.0))
        pyro.sample("mu", dist.Normal(0.0, 5.0))

    with pytest.raises(ValueError, match=r"latent site 'tau' initial values outside its support or not finite .*"
                                         r"\[inf\]\. `init_to_mean` gives .* use `init_to_median`"):
        from_model(model, init_strategy=init_to_mean)
    assert from_model(model, init_strategy=init_to_median).layout.names == ("mu", "tau")


def test_flat_coordinates_are_those_the_potential_does_not_depend_on():
    """Named in the sites' unconstrained shapes; a coordinate whose gradient vanishes at one
    point only (b at 0, a[1,2] on one side of a ReLU) is not flat, and one point says nothing."""
    def U(p):
        return p["a"][0, 1] ** 2 + torch.relu(p["a"][1, 2]) + p["b"] ** 2 + 0 * p["c"].sum()

    flat = from_potential_fn(U, {"a": torch.zeros(2, 3), "b": torch.tensor(0.0), "c": torch.zeros(2)})
    gradients = [flat.value_and_grad(z)[1] for z in (flat.initial_z, flat.initial_z + 1, flat.initial_z - 0.5)]
    expected = ["a[0,0]", "a[0,2]", "a[1,0]", "a[1,1]", "c[0]", "c[1]"]
    assert flat_coordinates(flat.layout, gradients) == expected
    assert flat_coordinates(flat.layout, gradients[:2]) == expected
    assert flat_coordinates(flat.layout, gradients[:1]) == []


@pytest.mark.parametrize("cut", ["torch.tensor", "detach", None])
def test_a_gradient_that_misses_part_of_the_potential_is_found(cut):
    """Pyro's autograd gradient of a model that builds a tensor from latent values with
    ``torch.tensor`` (or ``.detach()``-es one) misses the likelihood's dependence on them;
    the potential's values do not. At points around the start: found where cut, never where
    not (also on eight schools)."""
    y = torch.randn(50, 2, generator=torch.Generator().manual_seed(0)) * torch.tensor([2.0, 0.5])
    flat = from_model(two_scales, (y, cut))
    points = [flat.initial_z + shift for shift in (0.0, 1.0, -1.5)]
    found = [gradient_mismatch(flat.potential, z, flat.value_and_grad(z)[1]) for z in points]
    if cut is None:
        assert found == [None] * 3
    else:
        assert all(f is not None and abs(f[0] - f[1]) > 0.25 * abs(f[0]) for f in found)
    eight = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    points = [eight.initial_z + torch.empty(eight.dim).uniform_(-2, 2, generator=torch.Generator().manual_seed(k))
              for k in range(5)]
    assert [gradient_mismatch(eight.potential, z, eight.value_and_grad(z)[1]) for z in points] == [None] * 5


def _bounded_by_latents(y):
    a = pyro.sample("a", dist.Uniform(1.0, 2.0))
    pyro.sample("b", dist.Uniform(0.0, a))
    pyro.sample("c", dist.Pareto(a, 3.0))  # support: greater than the scale
    pyro.sample("d", dist.Uniform(0.0, y.max()))  # bounded by the data only
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(a, 1.0), obs=y)


def test_sites_whose_support_moves_with_other_latent_sites_are_found():
    """Pyro fixes each site's transform at one run of the model: for ``b`` and ``c`` that
    fixes a support that moves with ``a``. A support set by the data does not move. The
    extra run of the model leaves the user's random stream as it was."""
    y = torch.tensor([1.0, 2.5])
    flat = from_model(_bounded_by_latents, (y,))
    z = flat.initial_z + torch.tensor([0.7, -1.2, 0.9, 0.4])  # (a, b, c, d) moved
    state = torch.get_rng_state()
    trace = trace_at(_bounded_by_latents, (y,), {}, flat, z)
    assert torch.equal(state, torch.get_rng_state())
    assert sites_with_moving_supports(trace, flat, z) == ["b", "c"]
    assert sites_with_moving_supports(trace, flat, z, skip={"c"}) == ["b"]
    eight = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    z = eight.initial_z + 1.0
    assert sites_with_moving_supports(trace_at(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA), {}, eight, z),
                                      eight, z) == []


def test_sites_that_come_and_go_with_latent_values_are_found():
    """A run where ``a`` is negative lacks ``b``; one from a layout without ``b`` samples it
    anew where ``a`` is positive. Eight schools has the same sites everywhere."""
    y = torch.tensor(0.5)
    with_b = from_model(site_only_where_positive, (y,), init_strategy=init_to_value(values={"a": torch.tensor(1.0)}))
    without_b = from_model(site_only_where_positive, (y,),
                           init_strategy=init_to_value(values={"a": torch.tensor(-1.0)}))
    assert with_b.layout.names == ("a", "b") and without_b.layout.names == ("a",)
    negative, positive = torch.tensor([-1.0, 0.0]), torch.tensor([1.0])
    assert sites_that_come_and_go(with_b.layout, trace_at(site_only_where_positive, (y,), {}, with_b,
                                                          negative)) == (["b"], [])
    assert sites_that_come_and_go(without_b.layout, trace_at(site_only_where_positive, (y,), {}, without_b,
                                                             positive)) == ([], ["b"])
    assert sites_that_come_and_go(with_b.layout, trace_at(site_only_where_positive, (y,), {}, with_b,
                                                          torch.tensor([2.0, 0.0]))) == ([], [])
    eight = from_model(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA))
    trace = trace_at(eight_schools, (EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA), {}, eight, eight.initial_z - 1.5)
    assert sites_that_come_and_go(eight.layout, trace) == ([], [])


def test_potential_must_be_scalar():
    with pytest.raises(ValueError, match="scalar"):
        from_potential_fn(lambda p: p["x"] ** 2, {"x": torch.zeros(3)})


def test_potential_non_finite_at_initial_point():
    with pytest.raises(ValueError, match="potential energy at the initial point"):
        from_potential_fn(lambda p: -torch.log(p["x"]).sum(), {"x": torch.tensor([-1.0])})


def _regression(x, y):
    slope = pyro.sample("slope", dist.Normal(0.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(slope * x, 1.0), obs=y)


@pytest.mark.parametrize("x, y, why", [
    (torch.ones(4), torch.tensor([0.0, 1.0, float("nan"), 2.0]),
     r"'y' \(observed\): 1 of 4 values are NaN, first at index \(2,\) \(if NaN marks missing values, observe the "
     r"others: keep = ~data.isnan\(\), then data\[keep\]"),
    (torch.tensor([1.0, float("nan"), float("nan"), 2.0]), torch.ones(4),
     r"'y' \(observed\): 2 of 4 values have a NaN log density: a parameter .* first at index \(1,\)"),
])
def test_data_without_a_finite_potential_get_an_error_naming_the_site_and_the_values(x, y, why):
    """NaN in the observations (pandas' mark of a missing value: the error says how to leave
    them out) and NaN in a covariate: Pyro says only "Model specification seems incorrect -
    cannot find valid initial params". (``MCMC.run`` turns Pyro's
    validation off, which would otherwise stop at the first invalid value.)"""
    with pytest.raises(ValueError, match="cannot find valid initial params.*" + why), pyro.validation_enabled(False):
        from_model(_regression, (x, y))


def test_empty_data_under_a_plate_get_a_line_saying_so():
    """``pyro.plate("data", len(y))`` of empty data: Pyro's kernels stop with "size cannot
    be zero", which names neither the plate nor the data."""
    with pytest.raises(ZeroDivisionError, match=r"(?s)size cannot be zero.*A `pyro.plate` of the model has size 0: "
                                                r"the data it runs over are empty"):
        from_model(_regression, (torch.zeros(0), torch.zeros(0)))


def _point_mass_of_a_constant():
    pyro.sample("x", dist.Delta(torch.tensor(1.0)))


def _point_mass_of_a_latent_value():
    z = pyro.sample("z", dist.Normal(0.0, 1.0))
    pyro.sample("x", dist.Delta(z + 1.0))


def _point_mass_in_the_likelihood(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    x = pyro.sample("x", dist.Delta(2 * mu))
    pyro.sample("y", dist.Normal(x, 1.0), obs=y)


@pytest.mark.parametrize("validation", [False, True])
@pytest.mark.parametrize("model", [_point_mass_of_a_constant, _point_mass_of_a_latent_value,
                                   _point_mass_in_the_likelihood])
def test_a_latent_point_mass_gets_an_error_naming_it(model, validation):
    """A ``Delta`` sample site without ``obs`` (a value recorded the way ``pyro.deterministic``
    does it) is a latent site with no density. Pyro stops on it with autograd's "does not
    require grad" or "appears to not have been used in the graph", or (validation off, the
    Delta in the likelihood) "cannot find valid initial params", naming no site; the error
    names it and says what to write instead."""
    args = (torch.tensor(1.0),) if model is _point_mass_in_the_likelihood else ()
    with pytest.raises(ValueError, match=r"latent sites \['x'\] are point masses .*pyro.deterministic"), \
            pyro.validation_enabled(validation):
        from_model(model, args)


def test_wrong_shape_initial_point():
    flat = from_potential_fn(lambda p: (p["x"] ** 2).sum(), {"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="expected \\(3,\\)"):
        check_initial_point(flat, torch.zeros(4))


def test_non_enumerable_discrete_site_gets_clear_error():
    def model():
        n = pyro.sample("n", dist.Poisson(3.0))
        pyro.sample("x", dist.Normal(n, 1.0), obs=torch.tensor(2.0))

    with pytest.raises(Exception, match="(?i)enumerat|discrete|support"):
        from_model(model)


def _subsampled(y):
    m = pyro.sample("m", dist.Normal(0.0, 1.0))
    with pyro.plate("n", len(y), subsample_size=2) as i:
        pyro.sample("y", dist.Normal(m, 1.0), obs=y[i])


def _wishart_covariance(y):
    cov = pyro.sample("S", dist.Wishart(df=torch.tensor(4.0), covariance_matrix=torch.eye(2)))
    pyro.sample("y", dist.MultivariateNormal(torch.zeros(2), covariance_matrix=cov), obs=y)


def _direction():
    pyro.sample("u", dist.ProjectedNormal(torch.tensor([1.0, 0.5, 0.0])))


def _mixture_of_intervals():
    components = dist.Uniform(torch.tensor([0.0, 2.0]), torch.tensor([1.0, 3.0]))
    pyro.sample("u", dist.MixtureSameFamily(dist.Categorical(torch.tensor([0.5, 0.5])), components))


@pytest.mark.parametrize("model, args, what", [
    (_subsampled, (torch.zeros(5),), "subsampling"),
    (_wishart_covariance, (torch.ones(2),), r"Cannot transform .*\{'S': 'PositiveDefinite'\}.*LKJCholesky"),
    (_direction, (), r"Cannot transform .*\{'u': 'Sphere'\}.*ProjectedNormal` direction \(u\).*ProjectedNormalReparam"),
    (_mixture_of_intervals, (), r"(?s)Cannot transform .*\{'u': 'MixtureSameFamilyConstraint'\}.*Give those sites a transform"),
])
def test_models_hmc_cannot_set_up_get_an_error_that_names_the_remedy(model, args, what):
    """Pyro refuses all four (subsampling; supports without a bijection, whose site Pyro's
    error does not name, among them a
    mixture whose components differ in their supports, which the default starting values
    cannot reach either); the error keeps Pyro's message and says what to change, for each
    support the change that fits it."""
    with pytest.raises(NotImplementedError, match=what):
        from_model(model, args)


def test_flat_priors_start_inside_their_supports_without_an_init_strategy():
    """``ImproperUniform`` (a flat prior, as a Stan model's unbounded parameter has) cannot be
    sampled, and Pyro's kernels need a prior draw for its starting value and for guessing
    the plates: they stop with "ImproperUniform does not support sampling" whatever
    ``init_strategy`` says. Here each site starts as ``init_to_uniform`` would start it
    (uniformly in (-2, 2) of its unconstrained space, as NumPyro does), and the plates are
    read from a run of the model at those values (a draw of the discrete sites, which are
    then summed out)."""

    def flat_priors(y):
        c = pyro.sample("c", dist.ImproperUniform(dist.constraints.ordered_vector, (), (2,)))
        with pyro.plate("groups", 3):
            mu = pyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), ()))
            with pyro.plate("n", len(y), dim=-2):
                shifted = pyro.sample("shifted", dist.Bernoulli(0.5), infer={"enumerate": "parallel"})
                pyro.sample("y", dist.Normal(mu + c.sum(-1, keepdim=True) + shifted, 1.0), obs=y)

    pyro.set_rng_seed(0)
    potential = from_model(flat_priors, (torch.zeros(4, 3),), num_chains=2)
    assert potential.layout.dim == 5
    assert potential.initial_zs.shape == (2, 5)
    assert bool(((potential.initial_zs > -2) & (potential.initial_zs < 2)).all())
    assert potential.initial_zs[0].tolist() != potential.initial_zs[1].tolist()
    assert bool(torch.isfinite(potential.potential(potential.initial_zs[0])))


def _flat_prior_no_site_uses(y):
    pyro.sample("unused", dist.ImproperUniform(dist.constraints.real, (), (2,)))
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _masked_out(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    with poutine.mask(mask=False):
        pyro.sample("unused", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("model", [_flat_prior_no_site_uses, _masked_out])
def test_latent_sites_the_density_does_not_depend_on_are_named(model):
    """A site whose log density is a constant and whose value no other site uses leaves the
    posterior improper along it, and autograd finds no gradient for it: Pyro stops with
    "appears to not have been used in the graph", which names no site."""
    with pytest.raises(ValueError, match=r"does not depend on the latent sites \['unused'\].*improper"):
        from_model(model, (torch.tensor(0.5),))


def test_the_remedy_the_error_gives_for_a_direction_sets_up():
    """``ProjectedNormalReparam`` samples the 3-vector that ``ProjectedNormal`` normalises."""
    potential = from_model(poutine.reparam(_direction, config={"u": ProjectedNormalReparam()}))
    assert potential.layout.dim == 3


def _linear_predictor(X, y):
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    pyro.sample("y", dist.Normal(X @ w, 1.0).to_event(1), obs=y)


def test_data_of_another_dtype_than_the_latent_values_get_an_error_that_says_so():
    """NumPy's float64 data with float32 latent values fail in the model's matrix product
    (Pyro's kernels too) with torch's "must have the same dtype" (before torch 2.13, at least
    in 2.8-2.10: "expected scalar type Double but found Float"); the error names the data and
    the two remedies. An error of another kind with such data gets no such hint."""
    X, y = torch.ones(3, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"(?s)(same dtype|scalar type).*not float32.*\(argument 0 is float64, "
                                           r"y is float64\).*dtype=torch.float32.*set_default_dtype"):
        from_model(_linear_predictor, (X,), {"y": y})
    with pytest.raises(RuntimeError) as caught:
        from_model(_linear_predictor, (torch.ones(3, 4, dtype=torch.float64),), {"y": y})
    assert "size mismatch" in str(caught.value) and "float32" not in str(caught.value)


def _logistic_regression(x, y, counts):
    b = pyro.sample("b", dist.Normal(0.0, 2.0))
    with pyro.plate("n", len(x)):
        pyro.sample("y", dist.Bernoulli(logits=b * x), obs=y)
        pyro.sample("counts", dist.Poisson(torch.exp(b * x)), obs=counts)


@pytest.mark.parametrize("dtype, torch_says", [("int64", "can't be cast"), ("bool", "two bool tensors")])
def test_integer_observations_that_a_distribution_refuses_get_an_error_naming_them(dtype, torch_says):
    """Binary outcomes read as integers (``int64`` from NumPy or pandas) or written as
    booleans (``x > 0``) fail in torch's ``Bernoulli.log_prob`` (Pyro's kernels too) with
    "result type Float can't be cast to the desired output type Long" or "Subtraction ...
    with two bool tensors is not supported", naming no site; the error names the site and
    the remedy. The Poisson counts beside them, which the Poisson takes as integers, are not
    named; as floats, both sample."""
    x = torch.linspace(-1.0, 1.0, 6)
    y, counts = (x > 0).to(getattr(torch, dtype)), torch.tensor([0, 1, 0, 2, 1, 3])
    with pytest.raises(RuntimeError, match=rf"(?s){torch_says}.*observed sites \{{'y': 'Bernoulli, {dtype}'\}} "
                                           r"have integer or boolean values.*y.float\(\)"):
        from_model(_logistic_regression, (x, y, counts))
    assert from_model(_logistic_regression, (x, y.float(), counts)).layout.names == ("b",)


def _with_torchs_distributions(y):
    mu = pyro.sample("mu", torch.distributions.Normal(0.0, 5.0))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_torchs_own_distributions_at_sample_sites_get_an_error_naming_them():
    """``pyro.sample`` with ``torch.distributions.Normal`` (Pyro's kernels too) fails with
    "'Normal' object is not callable", naming no site; the error names the site and says to
    use Pyro's distributions. The site written with Pyro's ``dist.Normal`` is not named."""
    with pytest.raises(TypeError, match=r"(?s)not callable.*sample sites \{'mu': 'torch.distributions.Normal'\} are "
                                        r"given torch's distributions.*import pyro.distributions as dist"):
        from_model(_with_torchs_distributions, (torch.zeros(3),))


def _observed_positionally(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    pyro.sample("y", dist.Normal(mu, 1.0).expand([len(y)]).to_event(1), y)


def test_data_passed_positionally_where_obs_was_meant_gets_an_error_naming_the_site():
    """``pyro.sample("y", d, y)`` without ``obs=`` hands ``y`` to the distribution as a sample
    shape and fails (Pyro's kernels too) with "torch.Size() takes an iterable of 'int'",
    naming no site; the error names the site and says to write ``obs=y``."""
    with pytest.raises(TypeError, match=r"(?s)torch.Size.*sample sites \['y'\] are given data as a positional "
                                        r"argument.*obs=y"):
        from_model(_observed_positionally, (torch.zeros(3),))


def _scale_plus_one(y, in_place):
    scale = pyro.sample("scale", dist.HalfNormal(1.0))
    if in_place:
        scale += 1.0
    else:
        scale = scale + 1.0
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(0.0, scale), obs=y)


@pytest.mark.parametrize("kernel_class", [NUTS, HMC])
def test_a_latent_value_changed_in_place_stops_the_run_naming_the_site(kernel_class):
    """``scale += 1.0`` changes the site's value after Pyro recorded it, and Pyro scores sites
    after the model has run: Pyro's kernels sample another model without a word (scale's
    HalfNormal density taken at scale + 1). The setup's model check names the site; written
    ``scale = scale + 1.0``, the model samples."""
    y = torch.tensor([0.5, -1.0, 2.0])
    with pytest.raises(ValueError, match=r"changes the values of the latent sites \['scale'\] in place .*"
                                         r"`s = s \+ 1`"):
        MCMC(kernel_class(_scale_plus_one), num_samples=5, warmup_steps=5, disable_progbar=True).run(y, True)
    mcmc = MCMC(kernel_class(_scale_plus_one), num_samples=5, warmup_steps=5, disable_progbar=True)
    mcmc.run(y, False)
    assert mcmc.get_samples()["scale"].shape == (5,)


def _through_numpy(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(mu + torch.as_tensor(np.tanh(mu.numpy())), 1.0), obs=y)


def _written_into(y):
    mu = pyro.sample("mu", dist.Normal(torch.zeros(2), 5.0).to_event(1))
    mu[1] = 0.0
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(mu[0], 1.0), obs=y)


@pytest.mark.parametrize("model, torch_says, line", [
    (_through_numpy, r"Can't call numpy\(\) on Tensor that requires grad. Use tensor.detach\(\).numpy\(\)",
     r"NumPy cannot follow the gradient .*`.detach\(\)`, which torch suggests, cuts it .*torch's functions"),
    (_written_into, "in-place operation", r"writes into a latent value in place .*`x = x.clone\(\)` first"),
])
def test_autograd_errors_of_the_models_arithmetic_say_what_to_write(model, torch_says, line):
    """A latent value through NumPy, or written into in place, stops Pyro's kernels with
    autograd's error (for NumPy, advice that cuts the gradient and makes the sampler wrong);
    the error says what to write instead."""
    with pytest.raises(RuntimeError, match=rf"(?s){torch_says}.*{line}"):
        from_model(model, (torch.zeros(3),))


def test_a_potential_fn_that_writes_into_its_params_gets_an_error_naming_them():
    """``q -= 1.0`` on a param: Pyro's kernels stop with autograd's "a leaf Variable that
    requires grad is being used in an in-place operation", naming nothing. The flat vector's
    params raise it for one site and, for several (views that one split made), "Output 0 of
    SplitWithSizes is a view and is being modified inplace"."""
    def shifted_in_place(params):
        q = params["q"]
        q -= 1.0
        return 0.5 * (q**2).sum()

    for params, torch_says in (({"q": torch.zeros(2)}, "in-place operation"),
                               ({"q": torch.zeros(2), "s": torch.tensor(0.0)}, "is being modified inplace")):
        with pytest.raises(RuntimeError, match=rf"(?s){torch_says}.*The potential_fn writes into one of its params "
                                               rf"\({', '.join(params)}\) in place .*`q = q - 1.0`"):
            from_potential_fn(shifted_in_place, params)


def _shifted_in_place(y, write):
    write(y)
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_data_changed_in_place_at_every_run_stop_the_setup_and_kept_ones_sample():
    """``y -= 1.0`` in the model shifts the data at every run: Pyro's NUTS ran on, the data
    at -273 after 200 draws (from 5), the draws following none of them. The setup names the
    argument. An in-place write that leaves the data as they were (``clamp_`` inside their
    range) samples, and the data stay."""
    y = torch.full((20,), 5.0)
    with pytest.raises(ValueError, match=r"the model changes its data \(argument 0\) in place at every run .*"
                                         r"`y = y - y.mean\(\)`"):
        from_model(_shifted_in_place, (y, lambda y: y.sub_(1.0)))
    y = torch.full((20,), 5.0)
    mcmc = MCMC(NUTS(_shifted_in_place), num_samples=200, warmup_steps=100, disable_progbar=True)
    mcmc.run(y, lambda y: y.clamp_(-10.0, 10.0))
    assert torch.equal(y, torch.full((20,), 5.0))
    assert_mean(mcmc.get_samples()["mu"].numpy(), 20 * 5.0 / (20 + 1 / 10.0**2))  # the exact posterior mean


def _mean_of(y):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("n", y.shape[0] if getattr(y, "ndim", 0) else 1):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.parametrize("data, kind", [(np.ones(4, dtype=np.float32), "ndarray"), (1.5, "float")])
def test_observations_that_are_not_tensors_get_an_error_naming_them(data, kind):
    """A NumPy array or a number given as ``obs`` fails in Pyro (its kernels too) with "object
    has no attribute 'dim'" or "'data'", naming no site; the error names the site, the type
    and the conversion."""
    with pytest.raises(AttributeError, match=rf"(?s)has no attribute.*sites \{{'y': '{kind}'\}} are not torch "
                                             r"tensors.*torch.as_tensor"):
        from_model(_mean_of, (data,))
    assert from_model(_mean_of, (torch.as_tensor(data, dtype=torch.float32),)).layout.names == ("mu",)


def _regression_on(x, y):
    b = pyro.sample("b", dist.Normal(0.0, 5.0))
    with pyro.plate("n", len(y)):
        pyro.sample("y", dist.Normal(b * x, 1.0), obs=y)


def test_covariates_that_are_numpy_arrays_get_an_error_naming_them():
    """A NumPy covariate times a latent tensor runs in NumPy and fails (Pyro's kernels too)
    with "Can't call numpy() on Tensor that requires grad"; the error names the argument and
    the conversion."""
    x = np.linspace(-1.0, 1.0, 5, dtype=np.float32)
    y = torch.as_tensor(2 * x)
    with pytest.raises(RuntimeError, match=r"(?s)numpy\(\).*model's arguments are NumPy or pandas arrays \(x "
                                           r"\(ndarray\)\).*torch.as_tensor"):
        from_model(_regression_on, (), {"x": x, "y": y})
    assert from_model(_regression_on, (torch.as_tensor(x), y)).layout.names == ("b",)


def _every_site_observed(mu, y):
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0), obs=mu)  # meant to be sampled: mu=None
    pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_a_model_without_latent_sites_gets_an_error_that_says_why():
    """Pyro's kernels run such a model and return no draws; a model whose unknowns all got
    data is a mistake, so the error says how it happens."""
    with pytest.raises(ValueError, match=r"no continuous latent sites .* observed \(`obs=`\) .* by mistake"):
        from_model(_every_site_observed, (torch.tensor(0.0), torch.tensor(1.0)))
