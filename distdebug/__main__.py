"""``python -m distdebug``: the same command as the ``distdebug`` console script."""

from distdebug.cli import main

if __name__ == "__main__":
    main()
