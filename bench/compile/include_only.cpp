// Compile cost: including the umbrella header and using nothing.
#include <kvevict/kvevict.hpp>

int include_only() {
  return 0;
}
