"""The top folder of a checkout of ple, which Python imports as ``ple`` when
it runs in the folder that holds a checkout named ``ple`` (and pytest, run in
the checkout, when it imports the folders above a test): there it would hide
the ple that is installed.  Run in the checkout, it is the checkout's own
ple (the package folder ple/, which ``make`` installs); run anywhere else,
importing it says what happened."""

if __name__ == "ple":
    import os

    _checkout = os.path.dirname(os.path.realpath(__file__))
    if os.path.realpath(os.getcwd()) != _checkout:
        raise ImportError(
            f"'ple' was imported from {os.path.dirname(os.path.abspath(__file__))}, a checkout of "
            "the ple repository, because Python runs in the folder that holds it: run Python "
            "from another folder (or from the checkout itself) to import the installed ple")
    __path__[:] = [os.path.join(_checkout, "ple")]
    __file__ = os.path.join(_checkout, "ple", "__init__.py")
    with open(__file__) as _source:
        exec(compile(_source.read(), __file__, "exec"))
