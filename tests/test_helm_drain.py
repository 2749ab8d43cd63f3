"""The chart's drain settings: every worker gets `--drain-timeout` from drainTimeoutSeconds, and
its preStop sleep plus that timeout fit in terminationGracePeriodSeconds (else no render)."""

from __future__ import annotations

import pytest
import yaml

from tests.test_helm_chart import render


def _workers(values: dict | None = None) -> dict[str, dict]:
    """component -> its Deployment's pod spec, from a render."""
    specs = {}
    for path, text in render(values).items():
        if not path.endswith(("prefill-deployment.yaml", "decode-deployment.yaml")):
            continue
        for document in yaml.safe_load_all(text):
            if document and document.get("kind") == "Deployment":
                spec = document["spec"]["template"]["spec"]
                specs[spec["containers"][0]["name"]] = spec
    return specs


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize(("component", "seconds"), [("prefill", 12), ("decode", 40)])
def test_drain_timeout_comes_from_the_values_and_fits_the_grace_period(component, seconds):
    spec = _workers({component: {"drainTimeoutSeconds": seconds}})[component]
    container = spec["containers"][0]
    assert float(_flag(container["args"], "--drain-timeout")) == seconds
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop + seconds < spec["terminationGracePeriodSeconds"]


def test_defaults_fit_their_grace_periods():
    for spec in _workers().values():
        container = spec["containers"][0]
        drain = float(_flag(container["args"], "--drain-timeout"))
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert drain > 0 and pre_stop + drain < spec["terminationGracePeriodSeconds"]


def test_a_drain_longer_than_the_grace_period_does_not_render():
    values = {"decode": {"terminationGracePeriodSeconds": 60, "drainTimeoutSeconds": 50}}
    with pytest.raises(Exception, match="drainTimeoutSeconds"):  # preStop 15 + 50 >= 60
        render(values)
