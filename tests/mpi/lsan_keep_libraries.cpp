// Linked into every MPI program of ours (tests, example, tool). Under AddressSanitizer only:
// Open MPI dlclose()s its components (at MPI_Finalize, and the ones it does not select
// already during MPI_Init), so LeakSanitizer, which runs at exit, sees their allocations in
// "<unknown module>" and tests/lsan.supp cannot name them. Libraries that are never unloaded
// stay named; this definition takes the place of libc's for every library of the program.
#if defined(__SANITIZE_ADDRESS__) && defined(__linux__)
extern "C" int dlclose(void*) { return 0; }
#endif
