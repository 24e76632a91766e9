"""Fault injectors, one module per fault, registered by name (see issue: fault injection catalogue).

Depends on distdebug's public API only; distdebug never imports this package.
"""
