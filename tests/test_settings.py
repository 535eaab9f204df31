"""Settings: flags and environment variables map onto one typed object, bad values are named."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from services.learner.settings import LearnerSettings
from services.link.settings import LinkSettings
from services.orchestration.local.settings import UpSettings
from shared.settings import SettingsError
from shared.settings.cli import settings_from_args


def parse(cls, argv):
    return settings_from_args(cls, argv)


def test_flags_override_environment_which_overrides_defaults(monkeypatch):
    monkeypatch.setenv("DILOCO_H_STEPS", "7")
    monkeypatch.setenv("DILOCO_INNER_LR", "0.01")
    settings = parse(LearnerSettings, ["--inner-lr", "0.002", "--unit", "1", "--num-units", "2"])
    assert settings.h_steps == 7  # from the environment
    assert settings.inner_lr == 0.002  # the flag wins
    assert settings.batch_size == 16  # default


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--unit", "4", "--num-units", "4"], "unit 4 must be < num-units 4"),
        (["--job", "bad job!"], "--job"),
        (["--model", "huge"], "--model (env DILOCO_MODEL) = 'huge': Input should be 'tiny'"),
        (["--inner-lr", "-1"], "--inner-lr"),
        (["--nats-url", "http://x"], "expected nats://host:port"),
        (["--codec", "int3"], "--codec (env DILOCO_CODEC) = 'int3': Input should be 'fp32'"),
        (["--block-size", "100"], "multiple of 16"),
        (["--codec", "fp32", "--error-feedback"], "fp32 loses nothing"),
        (["--codec-threads", "-2"], "--codec-threads"),
        (["--h-steps", "zero"], "--h-steps"),
    ],
)
def test_invalid_values_name_the_flag(argv, fragment):
    with pytest.raises(SettingsError, match=None) as err:
        parse(LearnerSettings, argv)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("argv", "codec", "feedback"),
    [
        ([], "int8", False),
        (["--codec", "int2"], "int2", False),
        (["--codec", "int2", "--error-feedback"], "int2", True),
        (["--codec", "int4", "--error-feedback"], "int4", True),
        (["--codec", "bf16", "--no-error-feedback"], "bf16", False),
    ],
)
def test_codec_flags_build_the_codec_config(argv, codec, feedback):
    config = parse(LearnerSettings, argv).codec_config()
    assert (config.codec, config.error_feedback) == (codec, feedback)


def test_cli_reports_invalid_settings_with_exit_code_2(capsys):
    from services.cli import main

    assert main(["learner", "--unit", "-1"]) == 2
    assert "--unit" in capsys.readouterr().err


def test_up_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--help"])
    text = capsys.readouterr().out
    for flag in (
        "--learners",
        "--model",
        "--max-steps",
        "--h-steps",
        "--data-dir",
        "--gateway-port",
        "--max-duration-s",
        "--codec",
    ):
        assert flag in text
    assert "DILOCO_LEARNERS" in text


def test_config_file_sets_options_and_flags_and_env_win(tmp_path, monkeypatch):
    from services.outer.settings import OuterSettings

    config = tmp_path / "job.toml"
    config.write_text(
        '[job]\nmodel = "tiny"\nfragments = 2\n[outer]\nmerge-policy = "each"\n'
        "outer_lr = 0.5\nmin_quorum = 1\n[learner]\nh_steps = 7\n"
    )
    monkeypatch.setenv("DILOCO_OUTER_LR", "0.3")
    known = set(OuterSettings.model_fields) | set(LearnerSettings.model_fields)
    outer = settings_from_args(OuterSettings, {"num_units": 2}, str(config), known)
    assert (outer.model, outer.fragments, outer.merge_policy) == ("tiny", 2, "each")
    assert outer.outer_lr == 0.3  # the environment beats the file
    learner = settings_from_args(LearnerSettings, {"h_steps": 9}, str(config), known)
    assert learner.h_steps == 9  # the flag beats the file


def test_config_file_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("h_step = 3\n")
    with pytest.raises(SettingsError, match="unknown keys in the config file: h_step"):
        settings_from_args(LearnerSettings, {}, str(bad))
    broken = tmp_path / "broken.toml"
    broken.write_text("h_steps = = 3\n")
    with pytest.raises(SettingsError, match="cannot read config file"):
        settings_from_args(LearnerSettings, {}, str(broken))


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--outer-optimizer", "adam"], "--outer-optimizer (env DILOCO_OUTER_OPTIMIZER) = 'adam'"),
        (["--merge-policy", "sometimes"], "Input should be 'each' or 'quorum'"),
        (["--combine", "mean"], "Input should be 'weighted', 'rda', 'median' or 'trimmed_mean'"),
        (["--token-weighting", "bytes"], "--token-weighting (env DILOCO_TOKEN_WEIGHTING)"),
        (["--staleness-rule", "linear"], "Input should be 'constant', 'polynomial'"),
        (["--min-quorum", "3", "--num-units", "2"], "min-quorum 3 > num-units 2"),
        (["--grace-min-s", "5", "--grace-max-s", "1"], "grace-min-s 5.0 > grace-max-s 1.0"),
        (["--dn-period", "-1"], "--dn-period"),
    ],
)
def test_invalid_outer_algorithm_options_are_named(argv, fragment):
    from services.outer.settings import OuterSettings

    with pytest.raises(SettingsError) as err:
        parse(OuterSettings, argv)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--mix-alpha", "1.5"], "--mix-alpha"),
        (["--overlap-tau", "-1"], "--overlap-tau"),
        (["--slowdown", "0.5"], "--slowdown"),
        (["--fragments", "0"], "--fragments"),
        (["--mode", "sync", "--overlap-tau", "2"], "overlap-tau must be 0"),
    ],
)
def test_invalid_learner_sync_options_are_named(argv, fragment):
    with pytest.raises(SettingsError) as err:
        parse(LearnerSettings, argv)
    assert fragment in str(err.value)


def test_up_shares_the_budget_by_speed_and_validates_slowdowns():
    from services.orchestration.local.settings import UpSettings

    up = parse(UpSettings, ["--learners", "4", "--max-steps", "110", "--slowdowns", "1,1,2,4"])
    assert up.unit_steps() == [160, 160, 80, 40]
    assert sum(up.unit_steps()) == 440
    with pytest.raises(SettingsError, match="slowdowns needs 4 factors"):
        parse(UpSettings, ["--learners", "4", "--slowdowns", "1,2"])
    with pytest.raises(SettingsError, match="slowdowns must be numbers"):
        parse(UpSettings, ["--slowdowns", "fast,slow"])


def test_a_nats_cluster_is_an_odd_number_of_nodes_and_its_routes_are_urls():
    from services.orchestration.compose.settings import BrokerSettings

    up = parse(UpSettings, ["--nats-cluster", "3", "--chaos-mtbf-s", "60"])
    assert up.nats_cluster == 3
    assert parse(UpSettings, ["--nats-cluster", "3", "--chaos-services", "nats-2,outer"])
    with pytest.raises(SettingsError, match="an odd number"):
        parse(UpSettings, ["--nats-cluster", "2"])
    with pytest.raises(SettingsError, match="expected some of outer, nats-server"):
        parse(UpSettings, ["--chaos-services", "nats-0"])  # one server: no nodes to name
    routes = "nats-route://nats:6222, nats-route://nats-1:6222"
    broker = parse(BrokerSettings, ["--routes", routes, "--server-name", "nats"])
    assert broker.route_urls() == ["nats-route://nats:6222", "nats-route://nats-1:6222"]
    assert parse(BrokerSettings, []).route_urls() == []
    with pytest.raises(SettingsError, match="expected nats-route://host:port"):
        parse(BrokerSettings, ["--routes", "nats://nats:4222"])


def test_checkpoint_dir_defaults_to_none_and_round_trips_through_flags(monkeypatch):
    from shared.settings.cli import to_flags

    assert parse(LearnerSettings, []).checkpoint_dir is None
    assert to_flags(parse(LearnerSettings, []), ["checkpoint_dir"]) == []
    settings = parse(LearnerSettings, ["--checkpoint-dir", "/var/lib/diloco/ck"])
    assert settings.checkpoint_dir == "/var/lib/diloco/ck"
    flags = to_flags(settings, ["checkpoint_dir"])
    assert flags == ["--checkpoint-dir", "/var/lib/diloco/ck"]
    assert parse(LearnerSettings, flags).checkpoint_dir == "/var/lib/diloco/ck"
    monkeypatch.setenv("DILOCO_CHECKPOINT_DIR", "")  # empty: no checkpoints
    assert parse(LearnerSettings, []).checkpoint_dir is None
    monkeypatch.setenv("DILOCO_CHECKPOINT_DIR", "/tmp/ck")
    assert parse(LearnerSettings, []).checkpoint_dir == "/tmp/ck"


@pytest.mark.parametrize(
    ("cls", "argv", "fragment"),
    [
        (LinkSettings, ["--link", "10mb"], "expected a rate like 100mbit"),
        (LinkSettings, ["--name", "learner"], "expected a unit index below 100 or 'outer'"),
        (LinkSettings, ["--outages", "5s+1s,5.5s+1s"], "overlap"),
        (UpSettings, ["--link", "1mbit", "--links", "1mbit,2mbit,3mbit,4mbit"], "not both"),
        (UpSettings, ["--links", "1mbit,2mbit"], "expected 1 or 4 comma-separated links"),
        (UpSettings, ["--link-outages", "5s+1s"], "needs learners' links"),
        (UpSettings, ["--outer-link", "fast"], "expected a rate"),
    ],
)
def test_invalid_link_options_are_named(cls, argv, fragment):
    with pytest.raises(SettingsError) as err:
        parse(cls, argv)
    assert fragment in str(err.value)


def test_link_options_give_each_unit_its_link():
    argv = ["--learners", "2", "--links", "1mbit/10ms,5mbit", "--outer-link", "1gbit"]
    up = parse(UpSettings, argv)
    assert [spec.text() for spec in up.unit_links()] == ["1mbit/10ms", "5mbit/0ms"]
    assert up.outer_link_spec().rate_bps == 1e9
    assert parse(UpSettings, []).unit_links() is None
    link = parse(LinkSettings, ["--nats-url", "nats://10.0.0.2:4333", "--name", "outer"])
    assert link.upstreams() == [("10.0.0.2", 4333)] and link.link_spec().rate_bps is None
    cluster = parse(LinkSettings, ["--nats-url", "nats://a:1,nats://b:2", "--name", "0"])
    assert cluster.upstreams() == [("a", 1), ("b", 2)]


def _service_settings_classes():
    from services.gateway.settings import GatewaySettings
    from services.loadtest.settings import LoadtestSettings
    from services.orchestration.compose.settings import BrokerSettings, ControllerSettings
    from services.outer.settings import OuterSettings

    return {
        "up": UpSettings,
        "learner": LearnerSettings,
        "outer": OuterSettings,
        "gateway": GatewaySettings,
        "link": LinkSettings,
        "broker": BrokerSettings,
        "controller": ControllerSettings,
        "loadtest": LoadtestSettings,
    }


@pytest.mark.parametrize("command", list(_service_settings_classes()))
def test_help_gives_every_flag_its_description_default_and_env_var(command, capsys):
    from shared.settings import is_secret

    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    text = " ".join(out.split())  # undo argparse's line wrapping
    packed = "".join(out.split())  # ... which also breaks words at hyphens
    for name, field in _service_settings_classes()[command].model_fields.items():
        flag, env = "--" + name.replace("_", "-"), "DILOCO_" + name.upper()
        if is_secret(field):  # a command line shows in ps: the environment only
            assert f"{flag} " not in text and f"[env: {env}]" not in text
            continue
        default = "null" if field.default is None else field.default
        assert f"{flag} " in text
        assert f"(default: {default}) [env: {env}]" in text
        assert "".join((field.description or "").split()) in packed
    if command == "up":
        assert "--start-together, --no-start-together" in text


def test_a_command_line_beats_the_environment_which_beats_the_config_file(tmp_path, monkeypatch):
    config = tmp_path / "job.toml"
    config.write_text(
        "[learner]\nh-steps = 5\ninner_lr = 0.005\nbatch_size = 4\ndynamic-h = false\n"
    )
    monkeypatch.setenv("DILOCO_CONFIG", str(config))
    monkeypatch.setenv("DILOCO_INNER_LR", "0.004")
    monkeypatch.setenv("DILOCO_BATCH_SIZE", "8")
    args = build_parser().parse_args(["learner", "--batch-size", "2", "--dynamic-h"])
    from services.cli import _settings

    learner = _settings(LearnerSettings, args)
    assert learner.h_steps == 5  # the file
    assert learner.inner_lr == 0.004  # the environment beats the file
    assert learner.batch_size == 2  # the flag beats both
    assert learner.dynamic_h is True  # --dynamic-h beats the file's false
    assert learner.max_steps == 300  # the default
