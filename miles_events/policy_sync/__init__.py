"""External policy synchronizers: the seed's ``external_policy_sync_path`` plugins.

A plugin is what ``run.external_policy_sync_path`` names: a factory given the run's config
that returns an object with the hooks of ``api.PolicySync``. The policy-sync driver actor
(``actors.policy_sync``) loads it at start and runs each hook when the Coordinator asks,
handing it small typed facades (``api``) that work by commands and replies on the bus.
``shared_dir`` is the plugin shipped here: runs average their policies through a directory.
"""
