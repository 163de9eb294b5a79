// kvevict_cpu_isa: which CPU paths this machine supports and which one the process takes
// (kvevict/cpu_isa.hpp). scripts/test runs the unit suite once per supported path from
// `kvevict_cpu_isa --supported`.
#include <kvevict/cpu_isa.hpp>

#include <cstdio>
#include <cstring>

int main(int argc, char** argv) {
  const kvevict::cpu_isa_report& r = kvevict::cpu_isa_details();
  if (argc > 1 && std::strcmp(argv[1], "--supported") == 0) {
    for (int i = 0; i <= static_cast<int>(r.supported); ++i)
      std::printf("%s%s", i > 0 ? " " : "", kvevict::to_string(static_cast<kvevict::cpu_isa>(i)));
    std::printf("\n");
    return 0;
  }
  std::printf("kvevict CPU path: %s (supported up to %s; KVEVICT_ISA %s)%s%s\n", kvevict::to_string(r.active),
              kvevict::to_string(r.supported), r.requested ? "set" : "unset", r.note[0] != '\0' ? ": " : "", r.note);
  std::printf("kvevict ABI namespace of this build: %s\n", KVEVICT_ABI_NAMESPACE_NAME);
  return 0;
}
