"""The hybridtrain test suite (a package so the test files share :mod:`tests.helpers`)."""
