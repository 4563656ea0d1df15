"""gradpatch recipes: Lightning modules, TensorBoard logging, YAML configs and the `gradpatch` command line.

In progress: for now only the command line (`recipes.cli`, `gradpatch graph`) exists.
"""
