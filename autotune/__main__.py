from autotune.cli import main

if __name__ == "__main__":  # a spawned worker (the doctor's image pool) imports this module again, as __mp_main__
    raise SystemExit(main())
