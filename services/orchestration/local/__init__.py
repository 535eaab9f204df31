"""``diloco up``: a whole local cluster (nats-server, outer, gateway, learners), supervised.

* ``settings`` — ``UpSettings``, the options of ``diloco up``;
* ``run`` — ``run_up``: start, supervise and stop a run, decide when it is complete;
* ``cluster`` — the set of processes: start, heal, match with the registry, stop, PIDs;
* ``children`` — one supervised child process;
* ``commands`` — the command lines and environments of the own job's services;
* ``supervisor`` — the restart policy (pure);
* ``reconcile`` — which processes the registry's jobs need (pure);
* ``registry`` — reading the registry's jobs and desired states from KV;
* ``release`` — starting the own job's units together;
* ``progress`` — the progress line, throughput and summary shown to the user;
* ``files`` — the token, ``pids.json`` and ``summary.json`` in the data folder;
* ``broker`` — a nats-server child process.
"""
