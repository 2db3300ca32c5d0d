/* Preloaded by native/emulate.py where glibc is older than 2.38: the bochscpu-python wheel was linked against
 * glibc 2.38's C23 aliases of these functions and cannot be imported without them. Each forwards to the
 * function glibc has had for decades. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

unsigned long long __isoc23_strtoull(const char* s, char** end, int base) { return strtoull(s, end, base); }
long long __isoc23_strtoll(const char* s, char** end, int base) { return strtoll(s, end, base); }
unsigned long __isoc23_strtoul(const char* s, char** end, int base) { return strtoul(s, end, base); }
long __isoc23_strtol(const char* s, char** end, int base) { return strtol(s, end, base); }

int __isoc23_sscanf(const char* s, const char* format, ...) {
  va_list args;
  va_start(args, format);
  const int matched = vsscanf(s, format, args);
  va_end(args);
  return matched;
}
