"""Running a farm: the one-machine cluster launcher and the Prometheus and Grafana files."""
