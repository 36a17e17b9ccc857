from hybridtrain.cli import main

raise SystemExit(main())
