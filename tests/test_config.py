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


# ------------------------------------------------------------------------------ one declaration: the core's
import dataclasses  # noqa: E402
import typing  # noqa: E402

from qat_app.config import CODE_ONLY_FIELDS, QUANT_PARTS, core_fields  # noqa: E402

# a non-default value for each str field (other types get one from their type below); a new str field of
# the core fails test_every_core_field_is_a_flag until it gets a value here
STR_VALUES = {"format": "e5m2", "module_pattern": r"\.mlp\.down_proj$", "block_pattern": r"\.layers\.(\d+)\."}


def _other_value(field):
    """A valid value of ``field`` other than its default, as typed on the command line and as parsed."""
    args = typing.get_args(field.type)
    if typing.get_origin(field.type) is typing.Literal:
        value = next(a for a in args if a != field.default)
        return value, value
    if field.type is bool:
        return str(not field.default).lower(), not field.default
    if field.type is int:
        return str(field.default + 1), field.default + 1
    if field.type is float or float in args:
        return "0.5", 0.5
    assert field.name in STR_VALUES, f"core field {field.name} ({field.type}): give it a value in STR_VALUES"
    return STR_VALUES[field.name], STR_VALUES[field.name]


def test_quant_config_fields_are_exactly_the_cores():
    declared = [f.name for part in QUANT_PARTS.values() for f in dataclasses.fields(part)
                if f.init and f.name not in CODE_ONLY_FIELDS]
    assert [f.name for f in dataclasses.fields(QuantConfig)] == ["enabled", *declared]
    for core in core_fields():  # same type, default and documentation as the core declares
        mine = next(f for f in dataclasses.fields(QuantConfig) if f.name == core.name)
        assert (mine.type, mine.default) == (core.type, core.default)
        assert core.doc and core.doc in QuantConfig.__doc__, f"{core.part.__name__}.{core.name} is undocumented"


class _StopAfterParse(Exception):
    pass


@pytest.mark.parametrize("field", list(core_fields()), ids=lambda f: f.name)
def test_every_core_field_is_a_flag(field):
    """``--model.quant.<field>`` reaches the core config that declares the field, for every core field."""
    from qat_app.cli import QATCLI, cli_kwargs

    parsed = {}

    class ParseOnly(QATCLI):
        def before_instantiate_classes(self) -> None:
            parsed["quant"] = self.config.fit.model.quant.as_dict()
            raise _StopAfterParse

    typed, expected = _other_value(field)
    assert expected != field.default
    with pytest.raises(_StopAfterParse):
        ParseOnly(**cli_kwargs(), args=["fit", "--config", "configs/quickstart.yaml", f"--model.quant.{field.name}",
                                        typed], run=True)
    quant = QuantConfig.coerce(parsed["quant"])
    part = next(name for name, cls in QUANT_PARTS.items() if cls is field.part)
    assert getattr(quant.parts()[part], field.name) == expected


def test_coerce_reads_plain_dicts_and_names_unknown_keys():
    cfg = QuantConfig(amax_algo="exp_smooth", alpha=0.3)
    assert QuantConfig.coerce(cfg.to_dict()) == cfg
    assert QuantConfig.coerce({"history_len": 7}) == QuantConfig(history_len=7)  # absent: the core's default
    with pytest.raises(QuantConfigError, match=r"quant.histroy_len: not a quantization setting"):
        QuantConfig.coerce({"histroy_len": 7})


def test_module_hyperparameters_hold_plain_settings(tiny_model_dir):
    """Built from Python (not the CLI, whose config dump Lightning stores), a QATModule keeps the settings as a
    plain dict in its hyper-parameters -- what checkpoints and loggers store -- and rebuilds from them."""
    from qat_app.module import QATModule

    module = QATModule(model_name=str(tiny_model_dir), quant=QuantConfig(history_len=7, high_precision_layers=1))
    assert type(module.hparams["quant"]) is dict and module.hparams["quant"]["history_len"] == 7
    assert type(module.hparams["distill"]) is dict  # the other settings object too
    assert module.hparams_initial == module.hparams  # what the loggers write
    again = QATModule(**module.hparams)
    assert again.quant == module.quant and again.quant_report.modules == module.quant_report.modules
