"""The services only a docker-compose cluster runs (docker-compose.yml, docs/COMPOSE.md).

* ``diloco broker`` (``broker.py``): nats-server in its container, with the cluster's secrets
  (NATS users, TLS files, the gateway's API token) made once in the ``secrets`` volume, and
  reloaded whenever the controller adds a job's users.
* ``diloco controller`` (``controller.py``): the registry's reconcile loop of ``diloco up``, but
  each outer, learner and shaped link of a job created with ``POST /jobs`` is a container of its
  own, started through the Docker SDK (``docker_api.py``).
"""
