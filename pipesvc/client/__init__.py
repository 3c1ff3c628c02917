"""The Python client: ``connect`` to a coordinator, create jobs, train and run them.

Usage::

    import pipesvc
    with pipesvc.LocalCluster(num_stages=2) as cluster:
        client = pipesvc.connect(cluster.address)
        job = client.create_job(model="mlp", num_stages=2, loss="mse")
        loss = job.train_step(inputs, targets)
        job.close()

``connection`` holds ``Client`` and ``connect``, ``job`` the ``Job`` handle; what a job's
methods do at length is in ``training`` (requests, retries, the stream of steps),
``checkpoints`` (``Job.save``, ``resume_from``), ``export`` (``Job.save_pretrained``) and
``traces`` (``Job.timelines``, ``Job.trace``).
"""

from pipesvc.client.connection import Client, StageStatus, connect
from pipesvc.client.job import Job, Replan

__all__ = ["Client", "Job", "Replan", "StageStatus", "connect"]
