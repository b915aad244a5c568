// The usual visitor helper: std::visit(Overloaded{lambda...}, variant).
#pragma once

namespace tpipe {

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

} // namespace tpipe
