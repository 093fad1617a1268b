"""evalplane's AWS estate as Pulumi ComponentResources (issue 6).

`components.estate.build(EstateConfig)` composes every component and returns the stack outputs;
`__main__.py` calls it with the stack config, and the tests call it under Pulumi mocks.
"""
