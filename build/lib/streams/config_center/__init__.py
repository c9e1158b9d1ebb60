"""Config center (seed node 5): versioned, validated configuration on the compacted topic ``_tangram.config``.

* :mod:`streams.config_center.schemas`: the namespaces and the declared schema of every value;
* :mod:`streams.config_center.state`: changes, versions, diffs, scopes, snapshots — a pure fold;
* :mod:`streams.config_center.center`: :class:`ConfigCenter`, the writer (set, restore, snapshot…);
* :mod:`streams.config_center.subscriber`: :class:`ConfigSubscriber`, the live view processors embed;
* :mod:`streams.config_center.cli`: ``tangram config …``.
"""

from streams.config_center.center import CONFIG_TOPIC, ConfigCenter
from streams.config_center.schemas import NAMESPACES, ConfigSchemas, Declaration
from streams.config_center.state import AppliedChange, ConfigOp, Scope
from streams.config_center.subscriber import ConfigSubscriber

__all__ = ["CONFIG_TOPIC", "NAMESPACES", "AppliedChange", "ConfigCenter", "ConfigOp", "ConfigSchemas",
           "ConfigSubscriber", "Declaration", "Scope"]
