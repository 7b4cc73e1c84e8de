/* A fake libnccl.so.2 for tests: ncclGetVersion reports FAKE_CODE (major*10000 + minor*100 + patch),
 * and the read-only data holds the build string the real library carries ("NCCL version 2.26.2+cuda12.2"),
 * unless FAKE_VERSION_STRING is left undefined (a build whose string cannot be found). */

#ifndef FAKE_CODE
#error "compile with -DFAKE_CODE=<ncclGetVersion value>"
#endif

#ifdef FAKE_VERSION_STRING
__attribute__((used)) const char fake_nccl_version_string[] = FAKE_VERSION_STRING;
#endif

int ncclGetVersion(int *version) {
  if (!version) return 4; /* ncclInvalidArgument */
  *version = FAKE_CODE;
  return 0; /* ncclSuccess */
}
