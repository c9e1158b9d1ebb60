"""Deploy targets beyond the local stack: a Helm chart rendered from the topology (``tangram deploy k8s``).

docker-compose is a file in the repository (``docker-compose.yml``); Kubernetes gets a chart whose values
are computed from the topology, so replicas, partition bounds and topic specs are never typed twice.
"""

from streams.deploy.k8s import ChartSettings, chart_values, render_chart

__all__ = ["ChartSettings", "chart_values", "render_chart"]
