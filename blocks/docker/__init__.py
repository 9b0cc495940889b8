"""Train and serve on one Docker host (or podman), and build images: ``compute`` (``DockerCompute``), ``serving``
(``DockerServing``), ``image`` (``DockerImageBuilder``) over ``registry`` and ``context``; ``engine`` and
``transport`` reach the engine; ``spec`` writes the container's body; ``gpu_host`` and ``gpu_alloc`` choose a
host's GPUs; ``check`` is what ``gpuferry check`` asks.
"""
