"""Feature maps: registry, validation, randomness, kernel estimates."""

import math

import pytest
import torch

import hf_rfa
from hf_rfa.feature_maps import register_feature_map
from hf_rfa.feature_maps.base import FeatureMap

ALL = [n for n in hf_rfa.available_feature_maps() if n != "none"]  # "none" has no features: tests/ops/test_window_only.py
RANDOM = ["rff", "positive", "favor+", "favor++", "rfa"]


def test_registry_lists_required_maps():
    assert set(ALL) >= {"rff", "favor+", "positive", "favor++", "rfa", "hedgehog", "t2r", "elu"}


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown feature_map 'nope'.*favor\+.*hedgehog"):
        hf_rfa.build_feature_map("nope", head_dim=8)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_num_features(bad):
    with pytest.raises(ValueError, match="num_features"):
        hf_rfa.build_feature_map("favor+", head_dim=8, num_features=bad)


def test_bad_option_is_value_error():
    with pytest.raises(ValueError, match="bad options for feature map 'favor\\+'"):
        hf_rfa.build_feature_map("favor+", head_dim=8, num_features=4, colour="red")


def test_registry_rejects_duplicates_and_bad_names():
    with pytest.raises(ValueError, match="already registered"):
        register_feature_map("favor+")
    with pytest.raises(ValueError, match="must match"):
        register_feature_map("Bad Name")


@pytest.mark.parametrize("name", ALL)
def test_shapes_and_dtype(name):
    fm = hf_rfa.build_feature_map(name, head_dim=12, num_features=10, seed=1)
    x = torch.randn(2, 3, 5, 12, dtype=torch.bfloat16)
    for f in (fm.forward_queries(x), fm.forward_keys(x)):
        assert f.phi.shape == (2, 3, 5, fm.feature_dim)
        assert f.phi.dtype == torch.float32
        assert f.log_scale is None or f.log_scale.shape == (2, 3, 5)
        assert torch.isfinite(f.phi).all()


@pytest.mark.parametrize("name", [n for n in ALL if n not in ("rff", "rfa")])
def test_positive_maps_are_non_negative(name):
    fm = hf_rfa.build_feature_map(name, head_dim=16, num_features=64, seed=0)
    assert fm.positive
    x = torch.randn(1, 2, 50, 16, generator=torch.Generator().manual_seed(0))
    phi = fm.forward_queries(x).phi
    if name in ("positive", "favor+", "favor++", "elu", "hedgehog"):
        assert (phi > 0).all()  # strictly positive
    else:
        assert (phi >= 0).all()
    # large inputs: non-negative and finite (tiny features may underflow to 0 in float32)
    phi = fm.forward_keys(10 * x).phi
    assert (phi >= 0).all() and torch.isfinite(phi).all() and (phi.amax(-1) > 0).all()


def test_trig_maps_are_signed():
    for name in ("rff", "rfa"):
        fm = hf_rfa.build_feature_map(name, head_dim=16, num_features=64)
        assert not fm.positive
        assert (fm.forward_queries(torch.randn(1, 1, 20, 16)).phi < 0).any()


def test_orthogonal_projections_are_orthogonal_within_blocks():
    d, m = 16, 40
    fm = hf_rfa.build_feature_map("favor+", head_dim=d, num_features=m, seed=3)
    w = fm.omega.double()
    for start in range(0, m, d):
        block = w[start : start + d]
        unit = block / block.norm(dim=1, keepdim=True)
        gram = unit @ unit.T
        assert torch.allclose(gram, torch.eye(block.shape[0], dtype=gram.dtype), atol=1e-5)
    # norms follow chi(d): mean ≈ sqrt(d) (loose, 40 samples)
    assert abs(w.norm(dim=1).mean().item() - math.sqrt(d)) < 0.6
    iid = hf_rfa.build_feature_map("positive", head_dim=d, num_features=m, seed=3).omega.double()
    unit = iid[:d] / iid[:d].norm(dim=1, keepdim=True)
    assert not torch.allclose(unit @ unit.T, torch.eye(d, dtype=torch.float64), atol=1e-2)


@pytest.mark.parametrize("name", RANDOM + ["t2r"])
def test_redraw_is_deterministic(name):
    a = hf_rfa.build_feature_map(name, head_dim=8, num_features=16, seed=7)
    b = hf_rfa.build_feature_map(name, head_dim=8, num_features=16, seed=7)
    c = hf_rfa.build_feature_map(name, head_dim=8, num_features=16, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    key = "omega" if "omega" in sa else "weight_q"
    assert not torch.equal(sa[key], sc[key])
    if name == "t2r":
        return
    before = a.omega.clone()
    a.redraw(5)
    b.redraw(5)
    assert torch.equal(a.omega, b.omega) and int(a.step) == 5
    assert not torch.equal(a.omega, before)
    a.redraw(0)
    assert torch.equal(a.omega, before)


def _kernel_estimate(fm, x, y):
    fx, fy = fm.forward_queries(x), fm.forward_keys(y)
    dot = (fx.phi * fy.phi).sum(-1)
    ls = (fx.log_scale if fx.log_scale is not None else 0) + (fy.log_scale if fy.log_scale is not None else 0)
    return dot * torch.exp(ls)


@pytest.mark.parametrize("name", ["rff", "positive", "favor+", "favor++"])
def test_kernel_estimate_is_unbiased(name):
    """Averaged over many seeded draws, φ(x)·φ(y) → exp(x·y) (small norms)."""
    g = torch.Generator().manual_seed(0)
    d = 8
    x = 0.3 * torch.randn(1, 1, 20, d, generator=g)
    y = 0.3 * torch.randn(1, 1, 20, d, generator=g)
    exact = torch.exp((x * y).sum(-1))
    est = torch.stack([_kernel_estimate(hf_rfa.build_feature_map(name, head_dim=d, num_features=64, seed=s), x, y) for s in range(200)]).mean(0)
    assert (est / exact - 1).abs().max() < 0.05


def test_favor_plus_plus_has_lower_variance_than_positive():
    g = torch.Generator().manual_seed(1)
    d = 16
    x = 0.6 * torch.randn(1, 1, 64, d, generator=g)
    y = 0.6 * torch.randn(1, 1, 64, d, generator=g)
    exact = torch.exp((x * y).sum(-1))

    def mse(name):
        errs = []
        for s in range(30):
            fm = hf_rfa.build_feature_map(name, head_dim=d, num_features=32, seed=s, orthogonal=False)
            if name == "favor++":
                fm.calibrate(x, y)
            errs.append(((_kernel_estimate(fm, x, y) - exact) / exact).pow(2).mean())
        return torch.stack(errs).mean().item()

    assert mse("favor++") < 0.8 * mse("positive")


def test_favor_plus_plus_calibrate_sets_rho():
    fm = hf_rfa.build_feature_map("favor++", head_dim=4, num_features=8)
    x = torch.ones(1, 1, 3, 4)
    rho = fm.calibrate(x, x)
    assert rho == pytest.approx(4.0)  # ‖x+y‖²/d = 16/4
    assert float(fm.optimal_a(fm.rho)) < 0


@pytest.mark.parametrize("name", ["hedgehog", "t2r", "rfa"])
def test_learned_maps_have_trainable_parameters(name):
    fm = hf_rfa.build_feature_map(name, head_dim=8, num_features=8, num_heads=4, num_kv_heads=2)
    params = [p for p in fm.parameters() if p.requires_grad]
    assert params
    x = torch.randn(1, 4, 5, 8)
    fm.forward_queries(x).phi.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def test_hedgehog_identity_init():
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8)
    assert torch.equal(fm.weight_q[0], torch.eye(8))
    x = torch.randn(1, 1, 3, 8)
    expected = torch.softmax(torch.cat([x, -x], -1), -1)
    assert torch.allclose(fm.forward_queries(x).phi, expected, atol=1e-6)


def test_per_head_parameters_reject_wrong_head_count():
    fm = hf_rfa.build_feature_map("hedgehog", head_dim=8, num_features=8, num_heads=4)
    with pytest.raises(ValueError, match="heads"):
        fm.forward_queries(torch.randn(1, 3, 2, 8))


def test_is_a_feature_map():
    for name in ALL:
        assert isinstance(hf_rfa.build_feature_map(name, head_dim=8, num_features=4), FeatureMap)


@pytest.mark.parametrize("name", ["favor+", "positive", "favor++", "rff"])
def test_learnable_projections(name, tmp_path):
    """learnable=True: the step-0 draw becomes a trained parameter (same values, same state-dict
    key), gradients reach it, redraw is refused, and hf_rfa.redraw skips the map."""
    fixed = hf_rfa.build_feature_map(name, head_dim=8, num_features=16, seed=3)
    fm = hf_rfa.build_feature_map(name, head_dim=8, num_features=16, seed=3, learnable=True)
    assert torch.equal(fm.omega, fixed.omega)
    assert [n for n, _ in fm.named_parameters()] == ["omega"] and not list(fixed.parameters())
    assert set(fm.state_dict()) == set(fixed.state_dict())
    x = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0)) * 0.3
    fm.forward_queries(x).phi.sum().backward()
    assert fm.omega.grad is not None and fm.omega.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="learnable"):
        fm.redraw(1)
    with pytest.raises(ValueError, match="learnable"):
        hf_rfa.build_feature_map(name, head_dim=8, num_features=16, learnable="yes")


def test_redraw_skips_learnable_maps():
    from tiny_models import tiny_model

    model = hf_rfa.convert(tiny_model("llama"), feature_map="favor+", num_features=8, feature_map_options={"learnable": True})
    before = [fm.omega.detach().clone() for fm in hf_rfa.model_feature_maps(model)]
    assert hf_rfa.redraw(model, 5) == 0
    assert all(torch.equal(a, fm.omega) for a, fm in zip(before, hf_rfa.model_feature_maps(model)))
