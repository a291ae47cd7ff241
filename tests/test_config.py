"""QuantConfig validation: each bad value fails at construction, naming the field and allowed values."""

import pytest

from qat_app.config import QuantConfig, QuantConfigError


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"amax_algo": "median"}, r"quant.amax_algo: unknown algorithm 'median'; allowed: most_recent, exp_smooth, max, current"),
        ({"format": "int8"}, r"quant.format: unknown format 'int8'; allowed: e4m3, e5m2, hif8"),
        ({"history_len": 0}, r"quant.history_len: must be an integer >= 1"),
        ({"alpha": 0.0}, r"quant.alpha: must be in \(0, 1\]"),
        ({"alpha": 1.5}, r"quant.alpha: must be in \(0, 1\]"),
        ({"max_val": 0.0}, r"quant.max_val: must be in \(0, 32768\]"),
        ({"max_val": -1.0}, r"quant.max_val"),
        ({"high_precision_layers": -1}, r"quant.high_precision_layers: must be an integer >= 0"),
        ({"ste": "soft"}, r"quant.ste: unknown mode 'soft'; allowed: identity, clipped"),
        ({"module_pattern": "mlp.(("}, r"quant.module_pattern: not a valid regular expression"),
        ({"block_pattern": r"layers\.\d+"}, r"quant.block_pattern: needs one capturing group"),
        ({"format": "e4m3", "quantize_grads": True}, r"quant.grad_stochastic_rounding"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(QuantConfigError, match=message):
        QuantConfig(**kwargs)


def test_defaults_are_the_papers():
    cfg = QuantConfig()
    assert (cfg.format, cfg.amax_algo, cfg.history_len, cfg.resolved_max_val, cfg.high_precision_layers) == (
        "hif8", "max", 64, 15.0, 5)
    assert QuantConfig(format="e4m3").resolved_max_val == 448.0
