"""The alert and recording rules, one module per concern: each is a function `(policy) -> [Group]`.

A new rule goes into its concern's function; a new concern is a module here and one entry in
`trainguard.alerts.rules.CONCERNS` (or FLEET_CONCERNS), whose order is the order of the rendered files.
"""
