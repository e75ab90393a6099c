"""Several devices: layout (layout.py), process groups and collectives (groups.py), parallel layers
(layers.py, experts.py), weight shards (shards.py), a rank's start-up (runtime.py) and torchrun
(launch.py)."""
