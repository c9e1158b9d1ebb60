import re

from reference import REPO as PROJECT_ROOT
from streams.diagram import DIGEST_KEY, digest, png_text, render, to_dot, to_mermaid
from streams.topology import load_topology

TOPOLOGY = load_topology(PROJECT_ROOT / "topologies" / "predictive_maintenance" / "topology.yaml")
IMAGES = PROJECT_ROOT / "docs" / "images" / "predictive_maintenance"
REGENERATE = ("run `tangram diagram topologies/predictive_maintenance --out docs/images/predictive_maintenance` "
              "and commit docs/images/")


def test_dot_names_every_processor_topic_constraint_and_service():
    dot = to_dot(TOPOLOGY)
    assert dot == to_dot(TOPOLOGY)  # deterministic
    for name in TOPOLOGY.processors:
        assert f'"p:{name}"' in dot
    for topic in TOPOLOGY.topics:
        if topic != "pm.sim.labels":  # no processor reads or writes it: not part of the flow
            assert topic in dot
    assert "1 · Data ingress gateway" in dot and "3 · Model serving" in dot
    assert "timeout 2000 ms, 4 retries, breaker 5 fails / 10s" in dot
    assert "200/s, peak 2000/s for 60s, drop: never" in dot
    assert "SLA: p99 ≤ 2000 ms" in dot
    assert '"s:triton"' in dot and '"s:redis"' in dot


def test_mermaid_has_the_same_edges():
    text = to_mermaid(TOPOLOGY)
    assert text.startswith("flowchart LR")
    assert "pm.predictions.anomaly" in text and "dead letters" in text


def test_checked_in_pictures_are_up_to_date():
    tag = digest(to_dot(TOPOLOGY))
    svg = IMAGES.with_suffix(".svg").read_text()
    assert re.search(rf"<!-- {DIGEST_KEY}: (\w+) -->", svg).group(1) == tag, REGENERATE
    assert png_text(IMAGES.with_suffix(".png").read_bytes(), DIGEST_KEY) == tag, REGENERATE
    assert IMAGES.with_suffix(".mmd").read_text().startswith(f"%% {DIGEST_KEY}: {tag}"), REGENERATE


def test_render_writes_svg_png_and_mermaid(tmp_path):
    paths = render(TOPOLOGY, tmp_path / "t")
    assert [p.suffix for p in paths] == [".svg", ".png", ".mmd"]
    assert "<svg" in paths[0].read_text()
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_table_a_processor_joins_is_drawn_as_a_table_with_its_join():
    import yaml
    from reference import PM
    from streams.topology import Topology

    doc = yaml.safe_load((PM / "topology.yaml").read_text())
    doc["root"] = str(PM)
    doc["topics"]["pm.devices"] = {"schema": "pm.devices-value", "cleanup_policy": "compact"}
    doc["processors"]["features"]["tables"] = ["pm.devices"]
    topology = Topology.model_validate(doc)
    dot = to_dot(topology)
    assert '"t:pm.devices" [shape=cylinder' in dot and "table\\npm.devices" in dot
    assert '"producers" -> "t:pm.devices"' in dot
    assert '"t:pm.devices" -> "p:features" [label="join"' in dot
    assert '-.->|"join"| p_1' in to_mermaid(topology)  # features is the second processor
