"""Model families defined by the test suite alone: they reach hybridtrain only through a
``ModelSpec`` they register, which shows the generic code assumes no built-in family."""
