"""Fault injectors, one module per fault, registered by name (see issue: fault injection catalogue).

Depends on distdebug's public API only; distdebug's library never imports this package (its CLI does).
Imported as ``distdebug.fault_injection`` everywhere (installed, this folder is that subpackage; a
checkout maps the name here, distdebug/__init__.py), and its modules import each other relatively: one
name, so a fault class is never loaded twice as two classes.
"""
